"""Pieces of the exported Python recipes (hf-trainer and trl share them).

They are text: the recipes must run without autofit installed.
"""

from __future__ import annotations

import errno
import pprint

from autofit.config import distributed, recipe
from autofit.config.recipe import Arguments
from autofit.core.files import WRITE_FAILURES
from autofit.export.common import ExportRun, check_fields, comment_block
from autofit.export.fields import versions
from autofit.export.multi_gpu import script_doc

HEADER = '''#!/usr/bin/env python3
{provenance}
"""Fine-tune with the configuration autofit measured as the fastest that fits.

    {usage}
{distributed}
--dataset: JSONL with a "text" field per line, or a plain text file. The text is tokenized,
joined and cut into blocks of MAX_LENGTH tokens: every sequence is full, as in the probe that
measured this configuration (its speed and memory hold for exactly that).
"""

import argparse
import errno
import gc
import json
import logging
import os
import stat
import statistics
import sys
import tempfile
import time

# The allocator setting (and regional compilation) must be in place before torch and accelerate start.
for _key, _value in {environment!r}.items():
    os.environ.setdefault(_key, _value)
# bitsandbytes (imported by peft) logs a notice about an optional CPU kernel on every import; unused here.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))

torch = None  # imported by load_torch() once the arguments and the dataset are checked
'''

SETTINGS = '''
MODEL = {model!r}
# A shape preset has no weights and no tokenizer: random weights (same memory and speed as
# trained ones) and a byte-level stand-in tokenizer are used unless --model is given.
MODEL_CONFIG = {model_config}
MAX_LENGTH = {max_length}
WEIGHTS_DTYPE = {dtype!r}
ATTN_IMPLEMENTATION = {attn!r}
# Exactly the arguments autofit measured ({effective} sequences per optimizer step).
TRAINING_ARGS = {training_args}
LORA = {lora}
QUANTIZATION = {quant}
KBIT_PREPARATION = {kbit}
'''

HELPERS = '''
WRITE_FAILURES = {write_failures}  # autofit's own list (files.py): a disk or folder that takes no writes


def byte_tokenizer():
    """A stand-in tokenizer: one token per UTF-8 byte, plus <eos>. For measuring, not for models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    print("note: byte-level stand-in tokenizer (the model has none); use --model with real weights",
          file=sys.stderr)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def load_tokenizer(model_ref):
    if model_ref is None:
        return byte_tokenizer()
    tok = tokenizer_of(model_ref)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_of(model_ref):
    """The model's own tokenizer, or one line saying why it cannot be loaded (a folder saved without one)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_ref)
    except (OSError, ValueError) as e:
        fail(f"--model: cannot load a tokenizer from {model_ref} ({str(e).strip().splitlines()[0]}); give a "
             "folder that holds the tokenizer's files too (tokenizer.json or tokenizer.model)")


def load_torch():
    """Import torch (seconds) only once the arguments and the dataset are checked, so that a mistake in them
    is said at once; every function here uses the module's name `torch`."""
    global torch
    import torch as imported

    torch = imported


def fail(message, code=2):
    """A problem with the input: one line naming the file, exit 2 (no traceback); 4 for a folder that cannot
    be written (a full or read-only disk)."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(code)


def rank_device():
    """This process's device: the GPU torchrun gave it (LOCAL_RANK), or the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return f"cuda:{torch.cuda.current_device()}"


def zero3_init():
    """Under DeepSpeed ZeRO-3 transformers builds the model already sharded (deepspeed.zero.Init) while this
    object lives (it reads it through a weak reference); None for any other engine."""
    ds = TRAINING_ARGS.get("deepspeed")
    if not ds or ds["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds)


def build_model(model_ref):
    """The base model in the measured dtype, quantization and attention kernel, on this rank's device."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, WEIGHTS_DTYPE)
    device = rank_device()
    zero3 = zero3_init()  # kept alive while the model is built
    device_map = None if zero3 else {"": device}
    quant = None
    if QUANTIZATION is not None:
        quant = dict(QUANTIZATION)
        if "bnb_4bit_compute_dtype" in quant:
            quant["bnb_4bit_compute_dtype"] = getattr(torch, quant["bnb_4bit_compute_dtype"])
        quant = BitsAndBytesConfig(**quant)
    if model_ref is None:
        config = AutoConfig.for_model(**MODEL_CONFIG)
        # random weights to quantize are built in host memory: on the card they would need the 16-bit
        # model's memory that quantizing is meant to save (a 7B: 13 GB on a 12 GB card)
        with torch.device("cpu" if zero3 or quant is not None else device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        if quant is None:
            return model
        folder = tempfile.mkdtemp()  # random weights need saving once to be quantized on load
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        model_ref = folder
    return AutoModelForCausalLM.from_pretrained(model_ref, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                quantization_config=quant, device_map=device_map)


def adapt(model):
    """LoRA (and k-bit preparation) exactly as measured; checkpointing is left to the trainer."""
    model.config.use_cache = False
    if KBIT_PREPARATION is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, **KBIT_PREPARATION)
    if LORA is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    # as measured: the built model is frozen out of the garbage collector, so a collection does not
    # scan its many thousand objects in the middle of a step (a 1.1-1.4x step-time spike on a 7B)
    gc.collect()
    gc.freeze()
    return model


def steady_throughput(tokens, times, warmup=2):
    """The steps after the first `warmup` (compilation, allocator growth): their tokens over their time.
    With steps of varying content (dynamic padding) a median of per-step rates would weigh a step of
    short samples as much as a long one; the median and the spread are reported beside it, as the
    steps' own noise: a recipe against its probe is only as close as the host lets a process repeat."""
    first = warmup if len(times) > warmup else 0
    rates = [n / t for n, t in zip(tokens[first:], times[first:])]
    return {"steady_tokens": sum(tokens[first:]), "steady_seconds": sum(times[first:]),
            "tokens_per_s": sum(tokens[first:]) / sum(times[first:]),
            "tokens_per_s_median_step": statistics.median(rates),
            "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates)}


def token_counter(model, trained=True):
    """Counts the tokens of every forward pass, as the probe counted them: the label-bearing ones
    (`trained`, on data) or every token of the full blocks; returns a reader that resets the count. A
    step counts what it really trained: the short last step of an epoch, a dataset smaller than a step."""
    seen = [0]

    def hook(module, args, kwargs):
        if trained:
            labels = kwargs.get("labels")
            seen[0] += int((labels[..., 1:] != -100).sum()) if labels is not None else 0
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen[0] += ids.numel() if ids is not None else 0
    model.register_forward_pre_hook(hook, with_kwargs=True)

    def take():
        n, seen[0] = seen[0], 0
        return n
    return take


def below_one_step(rows, step_rows, unit):
    """Whether the data holds fewer rows (`unit`s) than one optimizer step trains over every rank
    (`step_rows`); says so, since each step then trains fewer tokens than the measured configuration."""
    if rows >= step_rows:
        return False
    print(f"note: --dataset gives {rows} {unit}{'' if rows == 1 else 's'} where one optimizer step trains "
          f"{step_rows}: each step trains what there is, so its tokens/s and peak are not the measured "
          "configuration's (the summary counts the tokens trained)", file=sys.stderr)
    return True


def throughput_callback(tokens_per_step, below_one_step=False):
    """Prints tokens/s and peak memory per optimizer step, and a summary at the end. `tokens_per_step`: a
    function giving the tokens (on this rank) of the step that just ended (`token_counter`);
    `below_one_step`: the dataset is smaller than one step (said in the summary)."""
    from transformers import TrainerCallback

    class Throughput(TrainerCallback):
        def __init__(self):
            self.times = []
            self.tokens = []
            self.t0 = None
            self.losses = []  # (step, mean loss since the last log): the loss curve, in the summary

        def on_step_begin(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            # this rank's tokens; the rate is the whole group's
            self.tokens.append(all_ranks(tokens_per_step(), args.device) if args.world_size > 1 else tokens_per_step())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, logs["loss"]))

        def on_train_end(self, args, state, control, model=None, **kw):
            if not state.is_world_process_zero:  # one summary for the group, from rank 0
                return
            from accelerate.state import AcceleratorState

            summary = {"steps": len(self.times), **steady_throughput(self.tokens, self.times),
                       "losses": self.losses, "world_size": args.world_size, "below_one_step": below_one_step,
                       # what Trainer really ran: FSDP, DEEPSPEED, MULTI_GPU (DDP), NO, ...
                       "distributed_type": str(AcceleratorState().distributed_type.value),
                       "sharded_parameters": sharded_parameters(model)}
            if torch.cuda.is_available():
                summary["max_memory_reserved"] = torch.cuda.max_memory_reserved()
                summary["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                free, total = torch.cuda.mem_get_info()
                summary["device_used"] = total - free
                summary["memory_reserved_now"] = torch.cuda.memory_reserved()
            print("recipe-summary " + json.dumps(summary), flush=True)

    return Throughput()


def all_ranks(count, device):
    """The sum of a count over every rank (a collective: each rank calls it at the same step)."""
    t = torch.tensor([count], device=device)
    torch.distributed.all_reduce(t)
    return int(t.item())


def sharded_parameters(model):
    """How many of the model's parameters are shards (DTensor, as FSDP2 leaves them) on this rank."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return 0
    return sum(isinstance(p, DTensor) for p in model.parameters()) if model is not None else 0


def arguments():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL if MODEL_CONFIG is None else None,
                   help="folder or hub id (default: the measured model%s)" % (
                       "; the measured preset has random weights" if MODEL_CONFIG else ""))
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--output-dir", default="autofit-out",
                   help="folder for the trained adapter or model, made (and written to) before training")
    p.add_argument("--max-steps", type=int, default=TRAINING_ARGS["max_steps"], help="optimizer steps")
    p.add_argument("--emulate-memory-gib", type=float,
                   help="cap this process's GPU memory (check the recipe for a smaller card on a bigger one)")
    a = p.parse_args()
    if a.model is None and MODEL_CONFIG is None:
        p.error("--model is required")
    if a.max_steps < 1:
        p.error(f"--max-steps: {a.max_steps} is not a number of optimizer steps; give 1 or more")
    if a.emulate_memory_gib is not None and not 0 < a.emulate_memory_gib < float("inf"):
        p.error(f"--emulate-memory-gib: {a.emulate_memory_gib} is not a memory size; give GiB above 0, such as 24")
    output_folder(a.output_dir)
    guard_stdout()
    return a


def guard_stdout():
    """What is printed on stdout (the summary, Trainer's logs) must never lose the training: a reader that went
    away (`| head`) or a full disk under a log file made the last print raise, and the model was not saved.
    A failed write sends stdout to /dev/null from then on, and says so once on stderr."""
    real = sys.stdout

    class Guarded:
        def write(self, text):
            try:
                return real.write(text)
            except OSError as e:
                self.lost(e)
                return len(text)

        def flush(self):
            try:
                real.flush()
            except OSError as e:
                self.lost(e)

        def lost(self, e):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, real.fileno())  # what is still buffered, and all that follows, goes nowhere
            os.close(devnull)
            print(f"note: standard output takes no more ({e.strerror}); the training goes on", file=sys.stderr)

        def __getattr__(self, name):
            return getattr(real, name)

    if real is not None:
        sys.stdout = Guarded()


def output_folder(path):
    """--output-dir made now, and written to once, so that a file in its place, a read-only or full disk
    says so before training, not in a traceback when the model is saved at the end."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:
        what = "exists and is not a folder" if os.path.exists(path) else "is a symbolic link that leads nowhere"
        fail(f"--output-dir: {path} {what}; give a folder for the trained model")
    except OSError as e:
        if e.errno in WRITE_FAILURES:
            fail(f"--output-dir: cannot write in {path} ({e.strerror}); give a writable folder", code=4)
        fail(f"--output-dir: {path}: {e.strerror}; give a folder for the trained model")


def check_kernels():
    """Liger's kernels (use_liger_kernel) need liger-kernel, triton and a CUDA GPU: say so before loading."""
    if not TRAINING_ARGS.get("use_liger_kernel"):
        return
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        fail("this recipe uses Liger's kernels (use_liger_kernel=True) and liger-kernel is not installed; "
             "pip install 'liger-kernel>=0.8.5' (it needs triton: a CUDA machine)")
    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
        fail("this recipe uses Liger's kernels (use_liger_kernel=True): Triton GPU kernels, and this machine "
             "has no " + ("triton" if importlib.util.find_spec("triton") is None else "CUDA GPU")
             + "; run it on the GPU it was measured for, or export a configuration with liger=off")
    print(f"liger-kernel {importlib.metadata.version('liger-kernel')}, torch {torch.__version__}", file=sys.stderr)


def emulate(limit_gib):
    if limit_gib and torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        outside = total - free - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction((limit_gib * 2**30 - outside) / total)
'''  # noqa: E501  a recipe's own code, written as it is

HELPERS = HELPERS.replace("{write_failures}", "{" + ", ".join(f"errno.{errno.errorcode[e]}"
                                                                for e in sorted(WRITE_FAILURES)) + "}")

BLOCK_HELPERS = '''

DATASET_HELP = "JSONL with a 'text' field, or a text file"


def read_texts(path):
    """The texts of --dataset: the "text" field of each JSONL line, or a whole text file (a pipe too:
    <(zcat data.jsonl.gz)); a device is refused (/dev/zero would be read for ever)."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            fail(f'--dataset: {path} is a device, not a file; give a JSONL file with a "text" field per line, '
                 "or a text file")
        with open(path, encoding="utf-8") as f:
            if path.lower().endswith((".jsonl", ".json", ".ndjson")):
                return [text_of(path, n, line) for n, line in enumerate(f, 1) if line.strip()]
            return [f.read()]
    except OSError as e:
        fail(f'--dataset: cannot read {path} ({e.strerror}); give a JSONL file with a "text" field '
             "per line, or a text file")
    except UnicodeDecodeError as e:
        fail(f"--dataset: {path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8")


def text_of(path, n, line):
    """The "text" field of line `n` of a JSONL file."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        fail(f"--dataset: {path} line {n} is not JSON ({e.msg}, column {e.colno}); each line must be an "
             'object such as {"text": "..."} (or give a file not ending in .jsonl to train on plain text)')
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        fail(f'--dataset: {path} line {n} has no "text" field holding a string; each line must be an '
             'object such as {"text": "..."}')
    return row["text"]


def packed_blocks(path, texts, tokenizer, length):
    """Token ids of all texts, joined with <eos> and cut into full blocks of `length`."""
    ids = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // length
    if n == 0:
        fail(f"--dataset: {path} holds {len(ids)} tokens, fewer than one block of {length}; give more text")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def prepare():
    """Arguments, tokenizer, the dataset packed into full blocks, and the adapted model."""
    a = arguments()
    texts = read_texts(a.dataset)  # a bad file fails here, before anything is loaded
    if not any(t.strip() for t in texts):
        fail(f'--dataset: {a.dataset} holds no text; give a JSONL file with a "text" field per line, or a text file')
    load_torch()
    check_kernels()
    emulate(a.emulate_memory_gib)
    tokenizer = load_tokenizer(a.model)
    blocks = packed_blocks(a.dataset, texts, tokenizer, MAX_LENGTH)
    return a, tokenizer, blocks, adapt(build_model(a.model))
'''  # noqa: E501  a recipe's own code, written as it is


def settings(r: ExportRun, max_steps: int = 1000) -> str:
    cfg = r.config
    on_cpu = r.best.target.get("device") == "cpu"
    args = recipe.training_arguments(cfg, on_cpu=on_cpu, max_steps=max_steps,
                                     gradient_accumulation_steps=r.accumulation)
    args["logging_steps"] = 10

    def fmt(obj: object) -> str:
        return pprint.pformat(obj, indent=1, width=100, sort_dicts=False)

    return SETTINGS.format(
        model=r.model.ref if r.model.kind not in ("preset", "config") else None,
        model_config=fmt(r.model.config) if r.model.kind in ("preset", "config") else "None",
        max_length=cfg.max_length, dtype=recipe.weights_dtype(cfg), attn=cfg.attn_implementation,
        effective=r.step_samples, training_args=fmt(args), lora=fmt(recipe.lora_arguments(cfg)),
        quant=fmt(recipe.quantization_arguments(cfg)), kbit=fmt(recipe.kbit_preparation(cfg)))


def header(r: ExportRun, name: str) -> str:
    launch = distributed.launch_command(r.config, name, "--dataset data.jsonl --output-dir out")
    options = "[--model PATH_OR_HUB_ID] [--max-steps N]"
    usage = f"{launch} {options}" if len(launch) + len(options) < 96 else f"{launch}\n    also: {options}"
    return HEADER.format(provenance=comment_block(r.provenance()), environment=recipe.process_env(r.config),
                         usage=usage, distributed=script_doc(r.config))


def check_fsdp_fields(names: dict[str, Arguments], have: dict[str, set[str]]) -> None:
    """The engine's fsdp_config keys against transformers' documented ones (both script formats)."""
    check_fields(have["fsdp_config"], names["training"].get("fsdp_config", {}),
                 f"transformers {versions()['transformers']} TrainingArguments fsdp_config (its documented "
                 "keys)")


def checked_names(r: ExportRun, max_steps: int = 1000) -> dict[str, Arguments]:
    cfg = r.config
    return {"training": recipe.training_arguments(cfg, on_cpu=False, max_steps=max_steps),
            "lora": recipe.lora_arguments(cfg) or {}, "quant": recipe.quantization_arguments(cfg) or {},
            "kbit": recipe.kbit_preparation(cfg) or {}}


TAIL = '''    trainer.train()
    trainer.save_model(a.output_dir)


if __name__ == "__main__":
    main()
'''
