"""The Python recipes (`hf-trainer`, `trl`): a short script a user keeps, the libraries doing the work.

The script is text (it runs where autofit is not installed), rendered from the winner's description
(`winner.Winner`): what the search decided is a block of constants at the top, and the rest is the usual
transformers / TRL program around them. Only what the winner needs is written: the quantization lines for a
quantized base, the Liger check for Liger, the engine's lines for several GPUs.

How each batching strategy is spelled (TRL 1.16, transformers 5.25):
- `blocks` (a run searched without --dataset: every sequence max_length long): TRL `packing_strategy=
  "wrapped"`; hf-trainer cuts the tokenized text into MAX_LENGTH blocks with a `datasets.map`;
- pad_max: padded to MAX_LENGTH (`pad_to_multiple_of`); pad_longest: to the longest of the micro-batch;
  group_by_length: the same in transformers' length-grouped order (`train_sampling_strategy`);
- padding_free: micro_batch_size samples flattened into one row (TRL `padding_free=True`, transformers'
  `DataCollatorWithFlattening`). TRL enforces no max_length there without packing, so the recipe cuts the
  samples to MAX_LENGTH itself;
- packed: TRL's best-fit-decreasing packing (`packing_strategy="bfd"`, padding-free rows of MAX_LENGTH), at the
  accumulation the probe's plan gave (`data.batching.step_shape`); hf-trainer packs with TRL's `pack_dataset`.
Samples longer than MAX_LENGTH are cut (TRL's `max_length`, the tokenizer's `truncation`), as the probe did.
The file is read with the `datasets` loader of the format autofit's reader found (DATA_FORMAT: JSONL rows in a
.txt are JSON, a folder of parquet files is read down its subfolders), whatever the file's name; a chat run reads
each row as the reader does, its chat where it has one, else its text (`TOKENIZED`).
Text rows get the tokenizer's special tokens and, through TRL, an end-of-sequence token; chats (`messages`
of {role, content}, ShareGPT's {from, value}) the tokenizer's chat template, or autofit's plain rendering
where it has none.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from autofit.config import distributed
from autofit.config.recipe import Arguments
from autofit.data.tokenizer import PLAIN_CHAT
from autofit.export.common import PLACEHOLDER, DataForm, ExportRun, comment_block, data_form
from autofit.export.winner import Winner

INDENT = "    "
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}" + PLAIN_CHAT.replace("{role}", "{{ m['role'] }}")
                       .replace("{content}", "{{ m['content'] }}") + "{% endfor %}")
"""autofit's rendering of a chat where the tokenizer has no template, as a chat template."""


def py(value: object) -> str:
    """A value as Python source (torch dtypes named `torch.X`, as the recipe imports torch)."""
    return repr(value)


def call(name: str, args: Arguments, torch_values: Iterable[str] = ()) -> str:
    """`Name(key=value, ...)` on one line; the keys in `torch_values` hold dtype names, written `torch.X`."""
    parts = [f"{k}=torch.{v}" if k in torch_values else f"{k}={py(v)}" for k, v in args.items()]
    return f"{name}({', '.join(parts)})"


TOGETHER = (("per_device_train_batch_size", "gradient_accumulation_steps"), ("max_steps", "learning_rate"),
            ("bf16", "fp16", "tf32"), ("optim", "activation_checkpointing"),
            ("report_to", "save_strategy", "logging_steps", "seed", "remove_unused_columns"),
            ("max_length", "dataset_text_field"),
            ("packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "train_sampling_strategy"))
"""Keys written on one line: the batch and its accumulation; the length of the run and its rate; the precision's
flags; the optimizer and the checkpointing; the bookkeeping that changes neither speed nor memory; the batching."""


def dict_block(name: str, items: dict[str, object], comments: dict[str, str]) -> list[str]:
    """`NAME = {` one key a line (the keys of a TOGETHER group on one), a comment where a value is surprising."""
    lines, done = [f"{name} = {{"], set()
    for key in items:
        if key in done:
            continue
        group = next((g for g in TOGETHER if key in g), (key,))
        keys = [k for k in group if k in items] if len(group) > 1 else [key]
        done.update(keys)
        said = [comments[k] for k in keys if k in comments]
        note = f"  # {'; '.join(said)}" if said else ""
        lines.append(INDENT + ", ".join(f"{k!r}: {py(items[k])}" for k in keys) + f",{note}")
    return [*lines, "}"]


# ----------------------------------------------------------------------------- what each strategy sets


def sft_fields(w: Winner) -> dict[str, object]:
    """SFTConfig's fields beside TrainingArguments' for the winner's batching (TRL 1.16)."""
    data = {"dataset_text_field": text_field(w)}
    if w.batching == "blocks":
        return {"max_length": w.max_length, "packing": True, "packing_strategy": "wrapped", "padding_free": False,
                **data}
    if w.batching == "packed":
        return {"max_length": w.max_length, "packing": True, "packing_strategy": "bfd", **data}
    if w.batching == "padding_free":
        return {"max_length": None, "packing": False, "padding_free": True, **data}
    pad = {"pad_to_multiple_of": w.max_length} if w.batching == "pad_max" else {}
    return {"max_length": w.max_length, "packing": False, "padding_free": False, **pad, **data}


def sampling_fields(w: Winner) -> dict[str, object]:
    """TrainingArguments' sampler for the batching (both formats)."""
    return {"train_sampling_strategy": "group_by_length"} if w.batching == "group_by_length" else {}


def comments(w: Winner, fmt: str) -> dict[str, str]:
    """The values a reader would not expect, each with why."""
    out = {}
    if w.config.torch_compile and w.config.precision == "bf16":
        out["bf16"] = "tf32 pinned: compiled in bf16, Trainer would turn TF32 matmuls on by itself"
    count = f"{w.step_samples:,.1f}".removesuffix(".0")
    if w.packed_on_average:
        out["gradient_accumulation_steps"] = f"packed rows: {count} samples per optimizer step on average, as " \
                                             f"measured{w.step_change}"
    elif w.batching != "blocks":
        out["gradient_accumulation_steps"] = f"{count} samples per optimizer step{w.step_change}"
    if w.batching == "padding_free":
        out["max_length"] = "TRL cuts nothing without packing: main() cuts the samples to MAX_LENGTH"
    if w.batching == "packed":
        out["packing"] = "best-fit decreasing: whole samples in rows of max_length, boundaries kept"
    if w.batching == "blocks":
        out["packing"] = "text cut into max_length blocks, as measured (no padding; TRL keeps a shorter last one)"
    if w.batching == "padding_free":
        out["packing"] = "micro_batch_size samples flattened into one row, positions restarting per sample"
    if w.training.get("use_cpu"):
        out["use_cpu"] = "measured on the CPU: set False to train on a GPU"
    return out


# ----------------------------------------------------------------------------- the script's parts


def header(r: ExportRun, w: Winner, fmt: str, name: str) -> list[str]:
    launch = distributed.launch_command(w.config, name, "")
    trainer = "TRL's SFTTrainer" if fmt == "trl" else "transformers' Trainer"
    doc = [f"Fine-tune with the configuration autofit measured as the fastest that fits ({trainer})."]
    if distributed.launched(w.config):  # one GPU: `python train.py --help` says it all
        doc += ["", f"    {launch} [--model PATH] [--dataset FILE] [--output-dir out] [--max-steps N]"]
    doc += multi_gpu_doc(w)
    text = "\n".join(doc).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    close = "\n" if len(doc) > 1 else ""
    return ["#!/usr/bin/env python3", comment_block(r.provenance()), f'"""{text}{close}"""', ""]


def multi_gpu_doc(w: Winner) -> list[str]:
    from autofit.export.multi_gpu import script_doc

    doc = script_doc(w.config)
    return ["", *doc.strip("\n").splitlines()] if doc else []


def imports(w: Winner, fmt: str, form: DataForm | None) -> list[str]:
    stdlib = ["argparse", "gc", "json", "os", "time"] + (["re"] if text_mode(w) == "paragraphs" else []) \
        + (["sys"] if w.config.gpus > 1 else [])
    if w.config.liger:
        stdlib.append("importlib.util")
    lines = [f"import {m}" for m in sorted(stdlib)] + [""]
    for key, value in w.environment.items():
        lines.insert(len(lines) - 1, f"os.environ.setdefault({key!r}, {value!r})  # before torch starts: as measured")
    if w.environment:
        lines.append("")
    lines += ["import torch", datasets_import(form)]
    peft = (["LoraConfig"] if w.lora else []) + (["get_peft_model"] if w.lora and fmt == "hf-trainer" else []) \
        + (["prepare_model_for_kbit_training"] if w.kbit else [])
    if peft:
        lines.append(f"from peft import {', '.join(peft)}")
    tf = ["AutoModelForCausalLM", "AutoTokenizer", "TrainerCallback"]
    tf += ["BitsAndBytesConfig"] if w.quantization else []
    if fmt == "hf-trainer":
        tf += ["Trainer", "TrainingArguments"] + ([hf_collator_class(w)] if w.batching in HF_COLLATED else [])
    lines.append(f"from transformers import {', '.join(sorted(set(tf)))}")
    if w.config.engine == "zero3":
        lines.append("from transformers.integrations import HfDeepSpeedConfig")
    if fmt == "trl":
        lines.append("from trl import SFTConfig, SFTTrainer")
    elif w.batching == "packed":  # TRL's best-fit-decreasing packing and its collator of packed rows
        lines.append("from trl.trainer.sft_trainer import DataCollatorForLanguageModeling, pack_dataset")
    elif w.batching not in HF_COLLATED:  # padded rows: the probe's collator (labels -100 past each row's end)
        lines.append("from trl.trainer.sft_trainer import DataCollatorForLanguageModeling")
    return lines


HF_COLLATED = ("blocks", "padding_free")
"""The hf-trainer recipe's batchings collated by transformers; the others by TRL's collator, as the probe collates
them. transformers' `DataCollatorForLanguageModeling` masks every label equal to the pad id, and a tokenizer
without a pad token pads with its end-of-sequence token: every EOS would go untrained."""


def datasets_import(form: DataForm | None) -> str:
    """What `load_data` takes of `datasets`: `Dataset` holds a text file's samples (the format's or the name's)."""
    text = form is None or form.format == "text"
    return f"from datasets import {'Dataset, ' if text else ''}load_dataset"


def hf_collator_class(w: Winner) -> str:
    return "DataCollatorWithFlattening" if w.batching == "padding_free" else "default_data_collator"


def decided(w: Winner, default_dataset: str, data_lines: list[str]) -> list[str]:
    """The top of a recipe's constants: the model, the dataset (and `data_lines`: its fields), the length, dtype,
    attention, quantization, k-bit preparation and LoRA the search decided (SFT and DPO recipes alike)."""
    model = (f"MODEL = {w.model!r}" if w.model is not None else
             f'MODEL = "{PLACEHOLDER}"  # measured on a shape preset (random weights): give a model of that shape')
    dataset = w.dataset.path if w.dataset is not None else default_dataset
    lines = ["", "# What the search decided.", model, f"DATASET = {dataset!r}", *data_lines,
             f"MAX_LENGTH = {w.max_length}", f"DTYPE = torch.{w.dtype}", f"ATTENTION = {w.attention!r}"]
    if w.quantization:
        lines.append("QUANTIZATION = " + call("BitsAndBytesConfig", w.quantization, ["bnb_4bit_compute_dtype"]))
    if w.kbit:
        lines.append(f"KBIT_PREPARATION = {w.kbit!r}")
    if w.lora:
        lines.append("LORA = " + call("LoraConfig", w.lora))
    return lines


def constants(w: Winner, fmt: str, form: DataForm | None) -> list[str]:
    data = [format_line(form.format)] if form is not None else []
    data.append(f"TEXT_FIELD = {text_field(w)!r}")
    if form is not None and form.chat:
        data.append(f"MESSAGES_FIELD = {w.dataset.messages_field if w.dataset else 'messages'!r}")
        data.append(f"PLAIN_CHAT = {PLAIN_CHAT_TEMPLATE!r}  # autofit's rendering where a tokenizer has no template")
    lines = decided(w, "data.jsonl", data)
    fields = {**w.training_for(fmt), **sampling_fields(w)}
    if fmt == "trl":
        fields = {**fields, **sft_fields(w)}
    return [*lines, *dict_block("TRAINING_ARGS", fields, comments(w, fmt))]


def format_line(loader: str) -> str:
    """DATA_FORMAT: how the search read the dataset, so that the recipe reads it (and a --dataset) so too."""
    return f"DATA_FORMAT = {loader!r}  # as the search read DATASET, whatever its name; a --dataset too"


def text_mode(w: Winner) -> str:
    """How the run read a text file (`TEXT_SPLITS`): its dataset's mode, lines where it was no text file, the
    whole text for a run searched without --dataset."""
    if w.dataset is None:
        return "whole"
    return w.dataset.text_mode if w.dataset.text_mode in TEXT_SPLITS else "lines"


def text_field(w: Winner) -> str:
    return w.dataset.text_field if w.dataset is not None else "text"


THROUGHPUT = '''


class Throughput(TrainerCallback):
    """Trained (label-bearing) tokens/s after two warm-up steps, the losses and the peak memory, as autofit counts."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.seen, self.tokens, self.times = 0, [], []
        model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):  # the tokens each forward trains: labels other than -100, shifted
        self.seen += int((kwargs["labels"][..., 1:] != -100).sum()) if kwargs.get("labels") is not None else 0

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.times.append(time.perf_counter() - self.start)
@TOKENS@        self.seen = 0

    def on_train_end(self, args, state, control, model=None, **kw):
        tokens, seconds = sum(self.tokens[2:] or self.tokens), sum(self.times[2:] or self.times)  # 2 warm-up steps
        losses = [(h["step"], h["loss"]) for h in state.log_history if "loss" in h]
        summary = {"steps": len(self.times), "tokens_per_s": tokens / seconds, "steady_tokens": tokens,
                   "steady_seconds": seconds, "losses": losses@GROUP@}
        if torch.cuda.is_available():  # the peak as autofit counts it: the most reserved, and memory outside torch
            free, total = torch.cuda.mem_get_info()
            summary.update(max_memory_reserved=torch.cuda.max_memory_reserved(), device_used=total - free,
                           memory_reserved_now=torch.cuda.memory_reserved())
@PRINT@
'''

ONE_RANK = ("        self.tokens.append(self.seen)\n", "", '        print("recipe-summary " + json.dumps(summary), '
            "flush=True)")
RANKS = ("        seen = torch.tensor([self.seen], device=args.device)\n"
         "        torch.distributed.all_reduce(seen)  # every rank's tokens: the rate is the group's\n"
         "        self.tokens.append(int(seen.item()))\n",
         ',\n                   "world_size": args.world_size, "distributed_type": distributed_type(),\n'
         '                   "sharded_parameters": sharded_parameters(model)',
         "        if state.is_world_process_zero:  # one summary for the group\n"
         '            print("recipe-summary " + json.dumps(summary), flush=True)')


def throughput(w: Winner) -> str:
    tokens, group, printed = RANKS if distributed.launched(w.config) else ONE_RANK
    return THROUGHPUT.replace("@TOKENS@", tokens).replace("@GROUP@", group).replace("@PRINT@", printed)


BY_NAME = ('{".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}.get(\n'
           '        os.path.splitext(path)[1].lower(), "arrow" if os.path.isdir(path) else "text")')
"""The loader of a file by its name: a run searched without --dataset measured no file to know it by."""
CSV_OPTIONS = ('{"keep_default_na": False, "na_values": [""], '
               '**({"sep": "\\t", "quoting": 3} if path.lower().endswith(".tsv") else {})}')
"""A CSV read as autofit's reader reads it: an empty cell is no value, but pandas' NA words (NA, null, N/A, ...)
are text; a .tsv file tab-separated with no quoting (csv.QUOTE_NONE: a cell may start with a quote)."""


def load_data(kind: str | None, mode: str) -> str:
    """The recipe's `load_data`: the file read with the `datasets` loader the search's reader read it as
    (DATA_FORMAT, whatever the file's name), in that loader's lines only; `kind` None: a loader by the file's name
    (a run searched without --dataset). `mode`: how a text file is split (`TEXT_SPLITS`)."""
    said, split = TEXT_SPLITS[mode]
    name = "kind" if kind is None else "DATA_FORMAT"
    newline = ', newline=""' if mode == "whole" else ""
    text = [f'with open(path, encoding="utf-8-sig"{newline}) as f:  # {said}, as the search read it',
            f"    return Dataset.from_dict({{TEXT_FIELD: [t for t in {split} if t.strip()]}})"]
    files_of = f".{kind}" if kind else ".parquet or .arrow"
    folder = [f"if os.path.isdir(path):  # its {files_of} files, in every subfolder (a DatasetDict: its train split)",
              '    split = "train" if os.path.isfile(os.path.join(path, "dataset_dict.json")) else ""',
              f'    path = os.path.join(path, split, "**", f"*.{{{name}}}")']
    csv_read = {None: f', **({CSV_OPTIONS} if kind == "csv" else {{}})', "csv": f", **{CSV_OPTIONS}"}.get(kind, "")
    files = f'return load_dataset({name}, data_files=path, split="train"{csv_read})'
    if kind is None:
        doc = "The rows of a JSONL/JSON/CSV/TSV/parquet file (by its name), a `save_to_disk` folder or a text file."
        body = [f"kind = {BY_NAME}", 'if kind == "text":', *("    " + line for line in text), *folder, files]
    else:
        doc = "The rows of a file as the search read DATASET: as DATA_FORMAT, whatever the file's name."
        body = text if kind == "text" else [*(folder if kind in ("parquet", "arrow") else []), files]
    return "\n\ndef load_data(path):\n" + "".join(f"    {line}\n" for line in [f'"""{doc}"""', *body])


TEXT_SPLITS = {
    "lines": ("one sample a line, blank lines skipped", "f.read().splitlines()"),
    "paragraphs": ("one sample a block of lines between blank lines",
                   '(p.strip("\\n") for p in re.split(r"\\n(?:[ \\t]*\\n)+", f.read()))'),
    "whole": ("the whole file one sample", "[f.read()]"),
}
"""How the recipe splits a text file as autofit's reader did (`data.reader.split_text`: line breaks made
'\\n' but for a whole file; the `datasets` text loader keeps blank lines and splits paragraphs at '\\n\\n'
only), by the run's text mode: what its comment says, and the expression."""


HF_BLOCKS = '''

def blocks(data, tokenizer):
    """The text tokenized, joined with end-of-sequence tokens and cut into full MAX_LENGTH blocks, as measured."""
    def cut(rows):
        ids = [t for text in rows[TEXT_FIELD] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
        ids = ids[:len(ids) // MAX_LENGTH * MAX_LENGTH]
        rows = [ids[i:i + MAX_LENGTH] for i in range(0, len(ids), MAX_LENGTH)]
        return {"input_ids": rows, "labels": rows}
    return data.map(cut, batched=True, remove_columns=data.column_names)
'''

def helpers(w: Winner, fmt: str, form: DataForm | None) -> str:
    parts = [throughput(w)]
    if distributed.launched(w.config):
        from autofit.export.multi_gpu import RANK_HELPERS

        parts.append(RANK_HELPERS)
    parts.append(load_data(form.format if form is not None else None, text_mode(w)))
    if fmt == "hf-trainer" and w.batching == "blocks":
        parts.append(HF_BLOCKS)
    if form is not None and form.chat:
        parts.append(TOKENIZED)
    if w.config.engine == "fsdp2":
        parts.append("\n\n" + inspect.getsource(distributed.fsdp_on_cpu))
    return "".join(parts)


ARGUMENTS = '''

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL, help="folder or hub id of the model, with its tokenizer")
    parser.add_argument("--dataset", default=DATASET, help="@DATASET_HELP@")
    parser.add_argument("--output-dir", default="autofit-out", help="where the trained adapter or model is saved")
    parser.add_argument("--max-steps", type=int, default=TRAINING_ARGS["max_steps"], help="optimizer steps")
    parser.add_argument("--emulate-memory-gib", type=float, help="cap the GPU's memory (a smaller card on this one)")
    a = parser.parse_args()
    if os.path.isfile(a.output_dir):
        parser.error(f"--output-dir: {a.output_dir} is a file; give a folder to save the trained model in")
    if os.path.isdir(a.model) and not {"tokenizer.json", "tokenizer_config.json"} & set(os.listdir(a.model)):
        parser.error(f"--model: {a.model} has no tokenizer files; give the model's folder with its tokenizer")
    if a.max_steps < 1:
        parser.error(f"--max-steps: {a.max_steps} is not a number of optimizer steps; give 1 or more")
    if a.emulate_memory_gib is not None and not 0 < a.emulate_memory_gib < float("inf"):
        parser.error(f"--emulate-memory-gib: {a.emulate_memory_gib} is not a memory size; give GiB above 0")
    if not os.path.isfile(a.dataset) and not os.path.isdir(a.dataset):
        parser.error(f"--dataset: cannot read {a.dataset}: not a file or a folder")
    try:
        data = load_data(a.dataset)
    except Exception as e:  # datasets' own error in one line: its cause's (the row it stopped at); none: no rows
        why = " ".join(str(e.__cause__ or e).split())[:300] or "it has no rows"
        parser.error(f"--dataset: cannot read {a.dataset} ({why}); `autofit data {a.dataset}` lists its bad rows")
@DATA_CHECK@@BEFORE_MODEL@    try:
        tokenizer = AutoTokenizer.from_pretrained(a.model)
    except OSError as e:  # neither a folder nor a hub id this machine has or can download
        why = "a placeholder: autofit ran a shape preset" if a.model == "PATH/TO/MODEL" else " ".join(str(e).split())
        parser.error(f"--model: cannot load {a.model} ({why[:300]}); give the model's folder")
'''
"""A recipe's main() up to its data and tokenizer: its flags and their checks (one line and exit 2 each), the
data read with `datasets`; `@DATASET_HELP@` and `@DATA_CHECK@` are the SFT or DPO recipe's (`arguments`)."""
TEXT_CHECK = '''    texts = data[TEXT_FIELD] if TEXT_FIELD in data.column_names else []
    if not texts or not all(isinstance(t, str) for t in texts):
        parser.error(f"--dataset: {a.dataset} has {'rows without' if texts else 'no rows with'} a {TEXT_FIELD!r} field")
'''
CHAT_CHECK = '''    if not len(data):
        parser.error(f"--dataset: {a.dataset} has no rows")
    column = lambda name: data[name] if name in data.column_names else [None] * len(data)
    if not all(isinstance(t, str) or m for t, m in zip(column(TEXT_FIELD), column(MESSAGES_FIELD))):
        parser.error(f"--dataset: {a.dataset} has rows with neither a {MESSAGES_FIELD!r} chat nor a {TEXT_FIELD!r} "
                     f"string; `autofit data {a.dataset}` lists them")
'''
"""What an SFT recipe trains: a text in every row (a text run), or a chat or a text (each row as the reader reads
it: its chat where it has one)."""


def arguments(dataset_help: str, data_check: str, before_model: str = "") -> str:
    """ARGUMENTS with the recipe's --dataset help, its check of what the data holds, and checks that come before
    the model is loaded (what this machine cannot run: Liger)."""
    return (ARGUMENTS.replace("@DATASET_HELP@", dataset_help).replace("@DATA_CHECK@", data_check)
            .replace("@BEFORE_MODEL@", before_model))

LIGER = '''    if importlib.util.find_spec("liger_kernel") is None or not torch.cuda.is_available():
        parser.error("this recipe uses Liger's kernels (use_liger_kernel=True): pip install 'liger-kernel>=0.8.5' "
                     "and run it on a CUDA GPU (this machine has no liger-kernel or no GPU), or export liger=off")
'''

EMULATE = '''    if a.emulate_memory_gib and torch.cuda.is_available():  # a smaller card's memory, this GPU's speed
        torch.zeros(1, device=f"cuda:{os.environ.get('LOCAL_RANK', 0)}")  # CUDA's context first: outside the cap
        free, total = torch.cuda.mem_get_info()
        outside = total - free - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction((a.emulate_memory_gib * 2**30 - outside) / total)
'''


def main_body(w: Winner, fmt: str, form: DataForm | None) -> list[str]:
    """main() after the argument checks: the data, the model, the trainer."""
    chat = form is not None and form.chat
    out = chat_lines(form, w.dataset.messages_field) if chat and form is not None and w.dataset else []
    if chat and fmt == "trl":
        out += ['    if {TEXT_FIELD, "messages"} <= set(data.column_names):  # text rows beside chats',
                "        data = tokenized(data, tokenizer)"]
    if fmt == "hf-trainer":
        out.append("    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token")
        if w.batching == "blocks":
            out += ["    data = blocks(data, tokenizer)", "    if not len(data):",
                    '        parser.error(f"--dataset: {a.dataset} holds fewer than MAX_LENGTH ({MAX_LENGTH}) tokens: '
                    'not one block to train")']
        else:
            out += ["    data = tokenized(data, tokenizer)"] if chat else hf_tokenize()
        if w.batching == "packed":
            out.append('    data = pack_dataset(data, MAX_LENGTH, strategy="bfd")  # best-fit decreasing, as measured')
    zero3 = w.config.engine == "zero3"
    if zero3:
        out.append('    zero3 = HfDeepSpeedConfig(TRAINING_ARGS["deepspeed"])  # ZeRO-3: the model is built sharded')
    load = "    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=DTYPE, attn_implementation=ATTENTION"
    if w.quantization:  # bitsandbytes quantizes on this rank's device
        out += ["    model = AutoModelForCausalLM.from_pretrained(",
                "        a.model, dtype=DTYPE, attn_implementation=ATTENTION, quantization_config=QUANTIZATION,",
                "        device_map={\"\": f\"cuda:{os.environ.get('LOCAL_RANK', 0)}\" if torch.cuda.is_available() "
                "else \"cpu\"})"]
    else:  # Trainer moves it to the device; ZeRO-3 builds it sharded
        out.append(load + ")")
    if w.kbit:
        out.append("    model = prepare_model_for_kbit_training(model, **KBIT_PREPARATION)")
    if fmt == "hf-trainer" and w.lora:
        out.append("    model = get_peft_model(model, LORA)")
    config = "SFTConfig" if fmt == "trl" else "TrainingArguments"
    out.append(f'    args = {config}(output_dir=a.output_dir, **{{**TRAINING_ARGS, "max_steps": a.max_steps}})')
    if w.config.engine == "fsdp2":
        out.append("    fsdp_on_cpu()  # on a CPU only: accelerate shards with FSDP for accelerator types alone")
    if fmt == "trl":
        peft = ", peft_config=LORA" if w.lora else ""
        out += ["    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer"
                f"{peft},", "                         callbacks=[Throughput()])"]
        if w.batching == "padding_free":
            cut = '{k: row[k][:MAX_LENGTH] for k in ("input_ids", "labels")}'
            out.append(f"    trainer.train_dataset = trainer.train_dataset.map(lambda row: {cut})")
    else:
        out += [f"    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator={hf_collator(w)},",
                "                      processing_class=tokenizer, callbacks=[Throughput()])"]
    out += ["    gc.freeze()  # as measured: a garbage collection never scans the model's objects in a step",
            "    trainer.train()", "    trainer.save_model(a.output_dir)"]
    out += ["    if torch.distributed.is_initialized():  # each rank ends its process group before it exits",
            "        torch.distributed.barrier()  # every rank's part of the save is done before one leaves",
            "        torch.distributed.destroy_process_group()"] if w.config.gpus > 1 else []
    out += ["", "", 'if __name__ == "__main__":', "    main()"]
    if w.config.gpus > 1:  # the rank's work is saved: torch's teardown can only abort it now (RANK_EXIT)
        out += RANK_EXIT
    return out


RANK_EXIT = [
    "    # The interpreter's teardown can abort a rank (exit -6) after its work is saved: a gloo thread still freeing",
    "    # a finished collective's tensors takes the GIL as Python shuts down (pytorch/pytorch#190489). End here.",
    "    sys.stdout.flush()",
    "    sys.stderr.flush()",
    "    os._exit(0)"]
"""How a multi-GPU recipe's rank ends once main() returned. Seen on the CPU under torchrun (gloo): a rank aborted at
Python's teardown in 2 of about 110 runs on a loaded 2-core machine, and in CI, with gloo's worker freeing an
all-gather's tensors (a core dump: `AsyncAllgatherCoalescedWork::~AsyncAllgatherCoalescedWork` -> `take_gil` ->
`pthread_exit` -> terminate). The process group stays referenced by DTensor's caches past `destroy_process_group`,
so its threads outlive it; torch's own fix, destroying the groups at exit (pytorch/pytorch#179291), was abandoned."""


def hf_tokenize() -> list[str]:
    """Each text row's token ids, cut to MAX_LENGTH, as TRL's SFTTrainer (and the probe) tokenizes it: the text with
    one end-of-sequence token after it, and the tokenizer's special tokens."""
    return ["    text = lambda row: row[TEXT_FIELD].removesuffix(tokenizer.eos_token) + tokenizer.eos_token  # as TRL",
            '    data = data.map(lambda row: {"input_ids": tokenizer(text(row), truncation=True, '
            'max_length=MAX_LENGTH)["input_ids"]},', "                    remove_columns=data.column_names)"]


TOKENIZED = '''

def tokenized(data, tokenizer):
    """Each row's token ids as the search counted them (as TRL's SFTTrainer tokenizes), cut to MAX_LENGTH: its chat
    where it has one, through the chat template (which writes the special tokens), else its text and an EOS token."""
    def ids(row):
        if row.get("messages"):
            text, special = tokenizer.apply_chat_template(row["messages"], tokenize=False), False
        else:
            text, special = row[TEXT_FIELD].removesuffix(tokenizer.eos_token) + tokenizer.eos_token, True
        return tokenizer(text, add_special_tokens=special, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    return data.map(lambda row: {"input_ids": ids(row)}, remove_columns=data.column_names)
'''
"""A chat run's rows tokenized one by one, as autofit's reader reads them (a chat, else a text): the hf-trainer
recipe's tokenization, and the trl recipe's where text rows sit beside chats (TRL reads one kind a dataset, its
first row's: a text first crashes on the chats, a chat first trains the texts without their EOS token)."""


def hf_collator(w: Winner) -> str:
    if w.batching == "blocks":
        return "default_data_collator"
    if w.batching == "padding_free":
        return "DataCollatorWithFlattening()"
    if w.batching == "packed":  # TRL's collator reads the packed rows' seq_lengths: positions restart per sample
        return "DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=True)"
    pad = ", pad_to_multiple_of=MAX_LENGTH" if w.batching == "pad_max" else ""
    return f"DataCollatorForLanguageModeling(tokenizer.pad_token_id{pad})"


SHAREGPT = '''        role = {"human": "user", "gpt": "assistant"}  # ShareGPT's {from, value}, as the search read it
        data = data.map(lambda row: {"messages": [{"role": role.get(m["from"], m["from"]), "content": m["value"]}
                                                  for m in row[MESSAGES_FIELD] or []]},
                        remove_columns=[MESSAGES_FIELD])'''
"""ShareGPT's chats as {role, content} messages (human -> user, gpt -> assistant, as autofit's reader maps them);
a text row beside them gets none."""


def chat_lines(form: DataForm, messages_field: str) -> list[str]:
    """Chats in the form both libraries read, a `messages` column of {role, content} (where the file holds them
    under another name, or as ShareGPT's {from, value}), and autofit's plain rendering where the tokenizer has no
    template."""
    lines = ["    tokenizer.chat_template = tokenizer.chat_template or PLAIN_CHAT"]
    if (form.role, form.content) == ("from", "value"):
        convert = SHAREGPT
    elif messages_field != "messages":
        convert = '        data = data.rename_column(MESSAGES_FIELD, "messages")'
    else:
        return lines
    return ["    if MESSAGES_FIELD in data.column_names:  # a file of text rows alone has none", convert, *lines]


def render_script(r: ExportRun, w: Winner, fmt: str, name: str, differs: list[str] | None = None) -> str:
    """The whole recipe: header, imports, the decided constants, the helpers and main(); `differs`: what it
    trains otherwise than the probe, said in comments above the constants."""
    form = data_form(w.dataset) if w.dataset is not None else None
    chats = form is not None and form.chat
    read = "JSONL/JSON/CSV/parquet/text file or save_to_disk folder" if form is None else \
        f"a file (or folder) read as '{form.format}' data whatever its name, as the search read its dataset"
    body = arguments(read, CHAT_CHECK if chats else TEXT_CHECK, LIGER if w.config.liger else "") + EMULATE
    said = [comment_block([f"DIFFERS FROM THE PROBE: {d}" for d in differs])] if differs else []
    lines = [*header(r, w, fmt, name), *imports(w, fmt, form), *said, *constants(w, fmt, form)]
    return "\n".join(lines) + helpers(w, fmt, form) + body + "\n".join(main_body(w, fmt, form)) + "\n"
