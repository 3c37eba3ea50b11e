"""Issue 29: Unsloth, the peer users pick for speed, beside autofit's winner in the same session.

Unsloth (2026.10.9) claims 1.87x Hugging Face on Llama-2-7B (LoRA/QLoRA, A100-40G). For S1 (Llama-2-7B
shape, LoRA r16 on q_proj,v_proj, bf16, 40 GiB, length 2048, global batch 16) and S5 (the same with a
4-bit nf4 base at 12 GiB, length 1024), this measures Unsloth's recommended recipe and autofit's winner
alternately (u, a, a, u, u, a), each run a fresh process with nothing else running beside it:
- Unsloth: `FastLanguageModel.from_pretrained` (the random-weight preset saved to disk once: Unsloth
  loads a model folder; `load_in_4bit` for S5), `FastLanguageModel.get_peft_model` with the same LoRA
  rank, alpha and targets, `use_gradient_checkpointing="unsloth"`, and TRL's `SFTTrainer` with the
  settings of its notebooks (per-device batch 2, `adamw_8bit`, lr 2e-4, linear schedule, warm-up 5,
  weight decay 0.01, seed 3407, no packing), accumulation making the global batch 16; random token ids,
  every sequence max_length, as autofit's probe trains;
- autofit: `autofit probe` of the scenario's winner (S1: micro-batch 3, Liger, no checkpointing,
  expandable_segments, the resumed kernel search's; S5: micro-batch 4, full checkpointing, adamw fused,
  expandable_segments, the landscape's best).
Unsloth's tokens/s and peak are counted as autofit's exported recipe counts them: every token of the
full rows over the steady steps' time (the steps after the first two, each step timed between device
synchronisations), peak = the allocator's reserved peak plus what the device holds outside it, under
the same memory cap (`set_per_process_memory_fraction`, as the recipe's --emulate-memory-gib does).

Unsloth needs a CUDA GPU and wheels the GPU machine lacks; `--pack` writes them (unsloth, unsloth_zoo,
trl 1.15, datasets, dill, multiprocess, cut_cross_entropy; Unsloth's Studio web app left out: 82 of its
89 MB) as .whl/unsloth-site.tgz (~6 MB). Unsloth requires transformers <= 5.17 (the GPU image's own), so
its processes run without the .gpu-site folder on their path, bitsandbytes excepted (linked from it).

    python bench/unsloth_recipe.py --pack                      # here: the wheels, packed
    # on the GPU, .gpu-site.tgz and .whl/ carried, after `source bench/gpu_env.sh`:
    python bench/unsloth_recipe.py --scenarios S1 --name unsloth-s1     # ~8 minutes
    python bench/unsloth_recipe.py --scenarios S5 --name unsloth-s5
    python bench/unsloth_recipe.py --scenarios S1-16 --name unsloth-s1-16   # both sides at 16 samples a step
    python bench/unsloth_recipe.py --scenarios S1-u8 --name unsloth-s1-u8   # Unsloth's recipe at micro-batch 8
    python bench/unsloth_recipe.py --train --model-dir DIR ...         # one Unsloth run (the child)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

UNSLOTH = "unsloth==2026.10.9"
WHEELS = (UNSLOTH, "unsloth_zoo==2026.10.9", "trl==1.15.0", "datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19",
          "cut_cross_entropy==25.1.1")
"""Unsloth and what it imports that the GPU image lacks (its METADATA's Requires-Dist checked against the
image's package list): trl <= 1.15 and datasets are required; xformers is optional (without it Unsloth uses
PyTorch's attention); tyro, hf_transfer, diffusers, msgspec, torchao and pydantic are not imported by
training (torchao and pydantic inside try blocks); bitsandbytes comes from .gpu-site."""
SITE_TGZ = ".whl/unsloth-site.tgz"
SITE = "/tmp/site-packages/.unsloth-site"  # where bench/gpu_env.sh unpacks the carried archives
GPU_SITE = "/tmp/site-packages/.gpu-site"
SCENARIOS: dict[str, dict[str, Any]] = {
    "S1": {"limit_gib": 40, "max_length": 2048, "load_in_4bit": False,
           "autofit": {"quantization": "none", "micro_batch_size": 3, "gradient_checkpointing": "off", "liger": "on",
                       "expandable_segments": "on", "optimizer": "adamw_torch_fused"}},
    "S5": {"limit_gib": 12, "max_length": 1024, "load_in_4bit": True,
           "autofit": {"quantization": "nf4", "micro_batch_size": 4, "gradient_checkpointing": "on",
                       "expandable_segments": "on", "optimizer": "adamw_torch_fused"}},
}
# S1's winner (micro-batch 3: 6 x 3 = 18 samples a step) does not keep the global batch of 16 that Unsloth's recipe
# trains (2 x 8); at micro-batch 2 it does (S1-16). S1-u8 gives Unsloth the card as well: its recipe at
# micro-batch 8 (2 steps of accumulation, 16 samples) against autofit's 16-sample config.
SCENARIOS["S1-16"] = {**SCENARIOS["S1"], "autofit": {**SCENARIOS["S1"]["autofit"], "micro_batch_size": 2}}
SCENARIOS["S1-u8"] = {**SCENARIOS["S1-16"], "unsloth_micro_batch": 8}
COMMON = {"method": "lora", "global_batch": 16, "lora_r": 16, "lora_alpha": 32, "lora_targets": "q_proj,v_proj",
          "precision": "bf16", "attn_implementation": "sdpa"}
RECOMMENDED = {"per_device_train_batch_size": 2, "optim": "adamw_8bit", "learning_rate": 2e-4, "warmup_steps": 5,
               "weight_decay": 0.01, "lr_scheduler_type": "linear", "seed": 3407, "packing": False}
"""SFTConfig of Unsloth's Llama notebooks (accumulation set for a global batch of 16)."""
NO_GPU = ("unsloth_recipe: Unsloth needs a CUDA GPU and this machine has none (torch.cuda.is_available() is "
          "False; Unsloth itself stops at import with 'Unsloth cannot find any torch accelerator? You need a "
          "GPU.'). Run it on the GPU machine (module docstring).")


# ----------------------------------------------------------------------------- here: the wheels


def pack() -> None:
    """Unsloth's wheels for the GPU machine, Studio removed (its web app: not used by training), packed."""
    from common import pack_site  # here only: the Unsloth child runs without autofit on its path

    pack_site("unsloth-site", WHEELS, drop=("studio",))


# ----------------------------------------------------------------------------- the child: one Unsloth run


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit(NO_GPU)


def emulate(limit_gib: float) -> None:
    """The card's memory on a bigger one, as autofit's exported recipe does (--emulate-memory-gib)."""
    import torch

    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((limit_gib * 2**30 - outside) / total)


def save_model(folder: Path, config: dict[str, Any]) -> None:
    """The preset's random weights and a word-level tokenizer covering its vocabulary, saved as a model folder
    (Unsloth loads folders; the data are token ids, so the tokenizer only has to exist and fit the vocab)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    net.save_pretrained(folder)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + [f"t{i}" for i in range(len(specials), config["vocab_size"])])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)


def unsloth_first() -> Any:
    """Unsloth's FastLanguageModel, imported before transformers, TRL and peft (it patches them as it imports;
    imported after them it warns that some optimizations are not applied)."""
    from unsloth import FastLanguageModel

    return FastLanguageModel


def train(a: argparse.Namespace) -> None:
    """One run of Unsloth's recommended recipe; prints `unsloth-summary {json}`."""
    require_gpu()
    emulate(a.limit_gib)
    fast_model = unsloth_first()
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    t0 = time.perf_counter()
    model, tokenizer = fast_model.from_pretrained(model_name=str(a.model_dir), max_seq_length=a.max_length,
                                                         dtype=torch.bfloat16, load_in_4bit=a.load_in_4bit)
    model = fast_model.get_peft_model(model, r=a.lora_r, target_modules=a.targets.split(","),
                                             lora_alpha=a.lora_alpha, lora_dropout=0, bias="none",
                                             use_gradient_checkpointing=a.checkpointing, random_state=3407)
    load_s = time.perf_counter() - t0
    mb = RECOMMENDED["per_device_train_batch_size"] if a.micro_batch is None else a.micro_batch
    acc = -(-a.global_batch // mb)  # ceil: the samples per step autofit trains at the same global batch
    rows = torch.randint(model.config.vocab_size, (a.steps * mb * acc, a.max_length),
                         generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": torch.ones_like(rows).tolist()})
    clock = StepClock(mb * acc * a.max_length)  # autofit's recipe counts the full rows of random tokens
    args = SFTConfig(output_dir=str(a.out), max_steps=a.steps, gradient_accumulation_steps=acc, logging_steps=1,
                     bf16=True, report_to="none", save_strategy="no", max_length=a.max_length, dataset_num_proc=1,
                     **{**RECOMMENDED, "per_device_train_batch_size": mb})
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=data, args=args,
                         callbacks=[clock.callback(TrainerCallback)])
    trainer.train()
    free, total = torch.cuda.mem_get_info()
    reserved_now = torch.cuda.memory_reserved()
    summary = {"steps": len(clock.times), **clock.steady(), "load_seconds": round(load_s, 1),
               # what Unsloth loaded: it falls back to 16 bits, saying so once, where it finds bitsandbytes unusable
               "loaded_in_4bit": bool(getattr(model, "is_loaded_in_4bit", False)),
               "linear_4bit_modules": sum(type(m).__name__ == "Linear4bit" for m in model.modules()),
               "micro_batch_size": mb, "gradient_accumulation_steps": acc, "checkpointing": a.checkpointing,
               "max_memory_reserved": torch.cuda.max_memory_reserved(),
               "max_memory_allocated": torch.cuda.max_memory_allocated(),
               # the probe's definition: the reserved peak plus what the device holds outside the allocator
               "peak_bytes": torch.cuda.max_memory_reserved() + max(total - free - reserved_now, 0),
               "step_times": [round(t, 4) for t in clock.times], "losses": clock.losses,
               "versions": versions("unsloth", "unsloth_zoo", "transformers", "trl", "peft", "torch", "bitsandbytes",
                                    "xformers", "cut_cross_entropy", "datasets")}
    print("unsloth-summary " + json.dumps(summary), flush=True)


def versions(*names: str) -> dict[str, str | None]:
    """What Unsloth's process ran with (its environment is not autofit's: the result file's own versions are
    the orchestrating process's)."""
    import importlib.metadata

    def one(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {name: one(name) for name in names}


class StepClock:
    """Times each optimizer step between device synchronisations, as the exported recipe's callback does."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.times: list[float] = []
        self.losses: list[tuple[int, float]] = []
        self.t0 = 0.0

    def callback(self, base: type) -> Any:
        import torch

        clock = self

        class Clock(base):  # type: ignore[misc, valid-type]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                torch.cuda.synchronize()
                clock.t0 = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                torch.cuda.synchronize()
                clock.times.append(time.perf_counter() - clock.t0)

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    clock.losses.append((state.global_step, logs["loss"]))

        return Clock()

    def steady(self, warmup: int = 2) -> dict[str, float]:
        """The steps after the first `warmup`: their tokens over their time (the recipe's steady_throughput)."""
        times = self.times[warmup:] if len(self.times) > warmup else self.times
        rates = [self.tokens_per_step / t for t in times]
        return {"tokens_per_s": self.tokens_per_step * len(times) / sum(times),
                "tokens_per_s_median_step": statistics.median(rates), "tokens_per_s_min": min(rates),
                "tokens_per_s_max": max(rates)}


# ----------------------------------------------------------------------------- the comparison


def unsloth_env() -> dict[str, str]:
    """Unsloth's processes: its own site first, bitsandbytes from .gpu-site (linked), never .gpu-site's
    newer transformers (Unsloth requires <= 5.17, the image's); offline, no statistics download."""
    for found in Path(GPU_SITE).glob("bitsandbytes*"):  # the package and its dist-info (versions are read from it)
        link = Path(SITE) / found.name
        if not link.exists():
            link.symlink_to(found)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": SITE, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false"}


def child(args: list[str], work: Path, timeout: float = 900) -> tuple[int, str, dict[str, Any]]:
    """This file in Unsloth's environment (cwd: `work`, where Unsloth writes its compiled cache)."""
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                              check=False, env=unsloth_env(), cwd=work, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {e.timeout} s", {}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("unsloth-summary ")]
    return proc.returncode, (proc.stderr + proc.stdout)[-2500:], json.loads(lines[-1].split(" ", 1)[1]) if lines else {}


def autofit_probe(sc: dict[str, Any]) -> dict[str, Any]:
    """`autofit probe` of the scenario's winner in a fresh process, as a user runs it."""
    from common import autofit_cli, run_brief

    from autofit.protocol.result import ProbeResult

    sets = [x for k, v in {**COMMON, "max_length": sc["max_length"], **sc["autofit"]}.items()
            for x in ("--set", f"{k}={v}")]
    proc = autofit_cli("probe", "--model", "llama2-7b", "--memory-limit", f"{sc['limit_gib']}GiB", "--json", *sets,
                       timeout=1200)
    try:
        res = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"outcome": "bench_error", "reason": proc.stderr[-1500:]}
    return run_brief(ProbeResult.from_dict(res))


def compare(name: str, sc: dict[str, Any], repeats: int, folder: Path, work: Path, figures: dict[str, Any],
            keep: Any) -> None:
    """Unsloth's recipe and autofit's winner alternately, `repeats` runs each."""
    from common import ratio_of_medians, spread_figure

    unsloth_mb = sc.get("unsloth_micro_batch", RECOMMENDED["per_device_train_batch_size"])
    out = figures["scenarios"][name] = {
        "unsloth": {"settings": {**RECOMMENDED, "per_device_train_batch_size": unsloth_mb,
                                 "use_gradient_checkpointing": "unsloth",
                                 "load_in_4bit": sc["load_in_4bit"], "max_length": sc["max_length"],
                                 "limit_gib": sc["limit_gib"]}, "runs": [], "figure": spread_figure([])},
        "autofit": {"config": {**COMMON, "max_length": sc["max_length"], **sc["autofit"]}, "runs": [],
                    "figure": spread_figure([])}}
    train_args = ["--train", "--model-dir", str(folder), "--max-length", str(sc["max_length"]),
                  "--limit-gib", str(sc["limit_gib"]), "--out", str(work / "out"), "--micro-batch", str(unsloth_mb),
                  *(["--load-in-4bit"] if sc["load_in_4bit"] else [])]
    good: dict[str, list[float]] = {"unsloth": [], "autofit": []}
    for i in range(repeats):
        for who in ("unsloth", "autofit") if i % 2 == 0 else ("autofit", "unsloth"):
            if who == "unsloth":
                rc, tail, summary = child(train_args, work)
                run = {"rc": rc, **summary, **({"tail": tail} if rc else {})}
                run["peak_gib"] = round(summary["peak_bytes"] / 2**30, 2) if summary.get("peak_bytes") else None
                tps = summary.get("tokens_per_s") if rc == 0 else None
            else:
                run = autofit_probe(sc)
                tps = run["tokens_per_s"] if run["outcome"] == "fit" else None
            out[who]["runs"].append(run)
            if tps:
                good[who].append(tps)
            out[who]["figure"] = spread_figure(good[who])
            # after every run: a call cut short at its time limit keeps the ratio of what it measured
            out["autofit_over_unsloth"] = ratio_of_medians(out["autofit"]["figure"], out["unsloth"]["figure"])
            print(f"{name} {who} {i}: {tps or 0:,.0f} tokens/s", flush=True)
            keep()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", action="store_true", help="write .whl/unsloth-site.tgz here (needs the package registry)")
    p.add_argument("--scenarios", default="S1,S5")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="unsloth-vs-autofit")
    # the child
    p.add_argument("--train", action="store_true", help="one Unsloth run (in Unsloth's environment)")
    p.add_argument("--save-model", metavar="DIR", help="save the llama2-7b preset with random weights (the child)")
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, help="per-device batch (default: the notebooks' 2)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps; the first 2 are not timed")
    p.add_argument("--limit-gib", type=float, default=40)
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--checkpointing", default="unsloth", help='use_gradient_checkpointing: "unsloth" (recommended), '
                                                              "true or false")
    p.add_argument("--out", type=Path, default=Path("unsloth-out"))
    a = p.parse_args()
    if a.checkpointing in ("true", "false"):
        a.checkpointing = a.checkpointing == "true"
    if a.pack:
        pack()
        return
    if a.save_model:
        require_gpu()
        save_model(Path(a.save_model), json.loads(os.environ["PRESET_CONFIG"]))
        return
    if a.train:
        train(a)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from common import save

    from autofit.config.models import PRESETS

    if not torch.cuda.is_available():
        sys.exit(NO_GPU)
    if not Path(SITE, "unsloth").is_dir():
        sys.exit(f"unsloth_recipe: no Unsloth at {SITE}: make {SITE_TGZ} here with --pack, carry it, and unpack it "
                 "there first (source bench/gpu_env.sh)")
    work = Path(tempfile.mkdtemp(prefix="unsloth-bench-"))
    folder = work / "llama2-7b-random"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--save-model", str(folder)],
                          capture_output=True, text=True, check=False, timeout=900,
                          env={**unsloth_env(), "PRESET_CONFIG": json.dumps(PRESETS["llama2-7b"])})
    figures: dict[str, Any] = {"unsloth": UNSLOTH, "model_saved_seconds": round(time.monotonic() - t0, 1),
                               "published": "Unsloth: 1.87x Hugging Face on Llama-2-7B QLoRA, one A100-40G (TRL's "
                                            "benchmark, SCENARIOS.md)",
                               "note": "figures: medians of fresh-process runs measured alternately in this call; "
                                       "spread = max/min; autofit_over_unsloth = median over median",
                               "scenarios": {}}
    if proc.returncode != 0:
        save(a.name, {**figures, "error": "saving the preset failed: " + proc.stderr[-2500:]})
        sys.exit(1)
    for name in a.scenarios.split(","):
        compare(name, SCENARIOS[name], a.repeats, folder, work, figures, lambda: save(a.name, figures))
    print(json.dumps({k: v.get("autofit_over_unsloth") for k, v in figures["scenarios"].items()}))


if __name__ == "__main__":
    main()
