"""`--format trl` for a preference-tuning winner (`trainer=dpo`): a short TRL DPOTrainer recipe (issue 32).

The same shape as the SFT recipe (`script.render_script`): what the search decided as constants at the top, a
Throughput callback, `load_data()` and `main()`. The DPO probe (`probe/child/dpo.py`) trains TRL 1.16's
DPOTrainer with the same DPOConfig fields: `max_length` (rows truncated keeping the start), checkpointing written
out (DPOConfig's own default is on), `precompute_ref_log_probs`, `pad_to_multiple_of=max_length` for pad_max, and
the reference as `dpo_reference` says: `shared` passes no ref_model (with a PEFT policy TRL disables the adapter
for the reference's forward), `copy` a second model of the same weights as `ref_model`. One GPU only (the DPO
rules of `config.spec`).
"""

from __future__ import annotations

import inspect
import re

from autofit.config import dpo
from autofit.export.common import ExportRun, comment_block
from autofit.export.script import (
    EMULATE,
    PLAIN_CHAT_TEMPLATE,
    THROUGHPUT,
    arguments,
    decided,
    dict_block,
    header,
)
from autofit.export.winner import Winner

PAIR_COUNT = ('    def count(self, module, args, kwargs):  # both rows of each pair in the policy\'s forward (the '
              'reference runs without grad)\n'
              '        mask = kwargs.get("attention_mask")\n'
              '        self.seen += int(mask.sum()) if mask is not None and torch.is_grad_enabled() else 0')
SFT_COUNT = THROUGHPUT[THROUGHPUT.index("    def count"):THROUGHPUT.index("\n\n    def on_step_begin")]
PAIRS = (',\n                   "pairs_per_s": len(self.times[2:] or self.times) * args.train_batch_size'
         ' * args.gradient_accumulation_steps / seconds')

THROUGHPUT_DOC = "Trained (label-bearing) tokens/s after two warm-up steps"
PAIRS_DOC = "Pairs/s and their tokens/s (both rows, padding aside) after two warm-up steps"
assert THROUGHPUT_DOC in THROUGHPUT

PAIRS_CHECK = '''    if not len(data) or not {"chosen", "rejected"} <= set(data.column_names):
        parser.error(f"--dataset: {a.dataset} has no preference pairs (rows with 'chosen' and 'rejected')")
'''
MAIN = arguments("preference pairs: a JSONL file or a JSON array, whatever its name", PAIRS_CHECK)
LOAD_PAIRS = '''

def load_data(path):
    """Preference rows of a JSONL file or a JSON array, whatever the file's name, as the search read them."""
    return load_dataset("json", data_files=path, split="train")
'''
"""The DPO recipe's reader: the search's (`data.preference`) reads JSON rows whatever the file's name."""


def dpo_fields(w: Winner) -> dict[str, object]:
    """DPOConfig's fields beside TrainingArguments' (those the DPO probe passes, `probe.child.dpo.dpo_arguments`)."""
    fields: dict[str, object] = {"max_length": w.max_length,
                                 # written: DPOConfig's own default is on, TrainingArguments' off
                                 "gradient_checkpointing": w.training["activation_checkpointing"]}
    if w.batching == "pad_max":
        fields["pad_to_multiple_of"] = w.max_length
    fields["precompute_ref_log_probs"] = w.config.precompute_ref_log_probs
    return fields


def training(w: Winner) -> dict[str, object]:
    """The TRAINING_ARGS of the DPO recipe: the probe's TrainingArguments with DPOConfig's fields."""
    return {**w.training, **dpo_fields(w)}


def render_dpo(r: ExportRun, w: Winner, differs: list[str]) -> str:
    """The DPO recipe: header, imports, the decided constants, the helpers and main()."""
    copy = w.config.dpo_reference == "copy"
    lines = header(r, w, "trl", "train_dpo.py")
    lines[-2] = lines[-2].replace("TRL's SFTTrainer", "TRL's DPOTrainer, on preference pairs")
    stdlib = ["argparse", "gc", "json", "os", "time"]
    lines += [f"import {m}" for m in stdlib] + [""]
    lines += [f"os.environ.setdefault({k!r}, {v!r})  # before torch starts: as measured" for k, v in
              w.environment.items()] + ([""] if w.environment else [])
    peft = (["LoraConfig"] if w.lora else []) + (["prepare_model_for_kbit_training"] if w.kbit else [])
    tf = ["AutoModelForCausalLM", "AutoTokenizer", "TrainerCallback"] + (["BitsAndBytesConfig"] if w.quantization
                                                                          else [])
    lines += ["import torch", "from datasets import load_dataset"]
    lines += [f"from peft import {', '.join(peft)}"] if peft else []
    lines += [f"from transformers import {', '.join(sorted(tf))}", "from trl import DPOConfig, DPOTrainer"]
    lines += [comment_block([f"DIFFERS FROM THE PROBE: {d}" for d in differs])] if differs else []
    lines += decided(w, "prefs.jsonl", [f"PLAIN_CHAT = {PLAIN_CHAT_TEMPLATE!r}  # conversations as measured where a "
                                        "tokenizer has no template"])
    reference = ("a separate copy of the base (dpo_reference=copy)" if copy else
                 "the policy with its adapter disabled (dpo_reference=shared, TRL's default with a PEFT model)")
    comments = {"precompute_ref_log_probs": "the reference's log-probs computed once before training"
                if w.config.precompute_ref_log_probs else f"the reference: {reference}",
                "max_length": "prompt + completion, truncated keeping the start (TRL's only mode)"}
    lines += dict_block("TRAINING_ARGS", training(w), comments)
    helpers = THROUGHPUT.replace(SFT_COUNT, PAIR_COUNT).replace("@TOKENS@", "        self.tokens.append(self.seen)\n")
    helpers = helpers.replace(THROUGHPUT_DOC, PAIRS_DOC).replace("@GROUP@", PAIRS).replace(
        "@PRINT@", '        print("recipe-summary " + json.dumps(summary), flush=True)')
    helpers += LOAD_PAIRS
    kept = dpo.needs_checkpointing_kept(w.config)
    if kept:  # the probe's own fix, as source (the annotation's type-checker comment is the project's, not yours)
        helpers += "\n\n" + re.sub(r"  # type: ignore\[[^]]*\]", "", inspect.getsource(dpo.keep_checkpointing_as_asked))
    body = ["    tokenizer.chat_template = tokenizer.chat_template or PLAIN_CHAT  # the probe's rendering without one"]
    load = "AutoModelForCausalLM.from_pretrained(a.model, dtype=DTYPE, attn_implementation=ATTENTION"
    if w.quantization:
        load += (', quantization_config=QUANTIZATION,\n        device_map={"": "cuda:0" if torch.cuda.is_available() '
                 'else "cpu"}')
    body.append(f"    model = {load})")
    if w.kbit:
        body.append("    model = prepare_model_for_kbit_training(model, **KBIT_PREPARATION)")
    if copy:
        body.append(f"    reference = {load})  # the reference: a separate copy (dpo_reference=copy)")
    if kept:
        body.append("    keep_checkpointing_as_asked()  # as measured: TRL's reference forward keeps the checkpointing")
    body.append('    args = DPOConfig(output_dir=a.output_dir, **{**TRAINING_ARGS, "max_steps": a.max_steps})')
    ref = "reference" if copy else "None"
    with_lora = ", peft_config=LORA" if w.lora else ""
    body += [f"    trainer = DPOTrainer(model=model, ref_model={ref}, args=args, train_dataset=data, "
             f"processing_class=tokenizer{with_lora},", "                         callbacks=[Throughput()])",
             "    gc.freeze()  # as measured: a garbage collection never scans the model's objects in a step",
             "    trainer.train()", "    trainer.save_model(a.output_dir)", "", "", 'if __name__ == "__main__":',
             "    main()"]
    return "\n".join(lines) + helpers + MAIN + EMULATE + "\n".join(body) + "\n"
