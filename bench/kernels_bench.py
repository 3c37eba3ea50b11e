"""Issue 12's GPU evidence: today's best config against the best with kernels, measured in one run.

Scenarios (SCENARIOS.md): S1 Llama-2-7B shape at 40 GiB, S2 the same at 24 GiB, S4 Qwen2.5-7B
shape (vocab 152,064) at 24 GiB; LoRA r16 on q_proj,v_proj, bf16, length 2048, global batch 16.
Targets: >= 1.10x on S1, >= 1.25x on S4. Where one is missed, a torch.profiler table of the
winner's step says where the time goes.

Two modes, both through the real CLI (subprocesses, as a user runs it):
- `--mode search` (default): `autofit search` over today's space and over the same space
  extended with `liger`, `torch_compile` and `attn_implementation`, one after the other, with
  the same budget; the ratio is best(kernels) / best(today), by the objective's speed (compile
  seconds amortised over --train-tokens). Then the kernel search's winner is exported
  (hf-trainer) and run for --export-steps steps under the same memory cap: tokens/s within 5% and
  peak within 3% of its probe; and its loss curve against the same recipe with stock kernels.
- `--mode probes`: `autofit probe` on a short list of points chosen from the hand measurements
  (SCENARIOS.md, 2026-12-03): cheap, and a check on what the search found.
- `--small`: the same pipeline on the CPU with tiny-llama (length 128, tiny spaces, a short budget):
  proves the plumbing, no GPU figures (Liger is `unsupported` there; torch_compile runs).

    python bench/kernels_bench.py --budget 20m                 # S1, S2, S4 searches, exports, curves
    python bench/kernels_bench.py --gpus 0,1,2,3,4,5 --budget 6m   # the same, every search on its own GPU
    python bench/kernels_bench.py --small --budget 150s        # the plumbing, on the CPU
    python bench/kernels_bench.py --mode probes --scenarios S1,S4
    python bench/kernels_bench.py --export-run RUN --reprobes 0 --export-steps 30 \\
        --curve-variants eager,liger                           # the loss curve's floor, and Liger's share
    python bench/kernels_bench.py --export-run RUN --reprobes 2 --warm-steps 30  # curves from a trained base
    python bench/kernels_bench.py --profile-point '{"micro_batch_size": 2, "liger": true}' \\
        --model llama2-7b --limit 40GiB                        # one profile, printed

MFU (stated with every figure): FLOPs per trained token =
  base: LoRA 4N without recomputation (forward 2N + activation gradients 2N; the frozen base
        needs no weight gradients), 6N with checkpointing on every layer (one more forward);
        full fine-tuning 6N, 8N with checkpointing; a partial (every_k) checkpoint adds 2N/k;
  attention: 12 * L * h * s (forward 4 * L * h * s for QK^T and PV at 2 FLOPs per multiply-add,
        backward twice that; no causal discount, as in PaLM's MFU), 16 * L * h * s with
        recomputation;
  N = the matmul parameters: every linear layer plus the output head (embedding lookups are free).
MFU = tokens/s * FLOPs per token / peak, against the H200's dense bf16 peak (989 TFLOP/s) and
against the bf16 matmul rate this bench measures on the card (8192^3 products).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import export_bench
from common import GIB, autofit_cli, bench_env, read_trials, save

from autofit.config.models import PRESETS
from autofit.data.correctness import FLOOR_FACTOR
from autofit.estimate.memory import Shape
from autofit.probe.child.kernels import TOLERANCES
from autofit.protocol.result import ProbeResult
from autofit.search.objective import best_of, speed

H200_BF16_DENSE_TFLOPS = 989.4
"""NVIDIA's H200 SXM datasheet figure, dense (no sparsity)."""
TRAIN_TOKENS = 50_000_000
"""Job length over which compile time is amortised in the report (a 3-epoch, 8k-sample LoRA run)."""
KERNEL_KEYS = ("liger", "torch_compile")


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    limit: str
    target: float | None
    """Required ratio best(kernels) / best(today), or None where the issue sets none."""
    points: list[dict[str, Any]] = field(default_factory=list)
    """`--mode probes`: today's best first, then kernel candidates (from the hand measurements)."""


COMMON = {"method": "lora", "max_length": 2048, "global_batch": 16, "lora_r": 16, "lora_alpha": 32,
          "lora_targets": "q_proj,v_proj", "precision": "bf16", "optimizer": "adamw_torch_fused",
          "attn_implementation": "sdpa"}
SMALL_COMMON = {**COMMON, "max_length": 128, "global_batch": 4}
"""--small: tiny-llama on the CPU, short sequences."""


@dataclass(frozen=True)
class Setup:
    """Where and how this bench runs (the GPU scenarios, or --small on the CPU)."""

    small: bool = False
    train_tokens: int = TRAIN_TOKENS
    export_steps: int = 50
    stock_reference: bool = True
    """Run the stock-kernel recipe beside the export for the loss curve (--no-stock-reference: speed and peak only)."""
    reprobes: int = 2
    """The winner probed again in the export's call (--reprobes): the recipe's same-conditions reference."""
    curve_variants: tuple[str, ...] = ()
    """--curve-variants: recipes beside the stock one for the loss curve (CURVE_VARIANTS)."""
    warm_steps: int = 0
    """--warm-steps: the loss curves start from the preset trained this many steps by the stock recipe."""
    gpus: tuple[int, ...] = ()
    """--gpus: the scenarios' searches at once, two GPUs a scenario (today's space, the extended one)."""

    def gpu_pair(self, index: int) -> tuple[int | None, int | None]:
        """The GPUs of the `index`-th scenario's two searches (None: the default device, one at a time)."""
        if len(self.gpus) < 2 * (index + 1):
            return None, None
        return self.gpus[2 * index], self.gpus[2 * index + 1]

    @property
    def common(self) -> dict[str, Any]:
        return SMALL_COMMON if self.small else COMMON

    @property
    def device_args(self) -> list[str]:
        return ["--device", "cpu"] if self.small else []

SCENARIOS = {
    "S1": Scenario("S1", "llama2-7b", "40GiB", 1.10, [
        {"micro_batch_size": 2, "gradient_checkpointing": "off"},
        {"micro_batch_size": 2, "gradient_checkpointing": "off", "liger": True},
        {"micro_batch_size": 3, "gradient_checkpointing": "off", "liger": True},
        {"micro_batch_size": 4, "gradient_checkpointing": "every_4", "liger": True},
        {"micro_batch_size": 2, "gradient_checkpointing": "off", "torch_compile": True},
        {"micro_batch_size": 2, "gradient_checkpointing": "off", "liger": True, "torch_compile": True},
    ]),
    "S2": Scenario("S2", "llama2-7b", "24GiB", None, [
        {"micro_batch_size": 6, "gradient_checkpointing": "on"},
        {"micro_batch_size": 8, "gradient_checkpointing": "on", "liger": True},
        {"micro_batch_size": 1, "gradient_checkpointing": "every_2", "liger": True},
        {"micro_batch_size": 2, "gradient_checkpointing": "every_4", "liger": True},
        {"micro_batch_size": 6, "gradient_checkpointing": "on", "torch_compile": True},
    ]),
    "S4": Scenario("S4", "qwen2.5-7b", "24GiB", 1.25, [
        {"micro_batch_size": 2, "gradient_checkpointing": "on"},
        {"micro_batch_size": 1, "gradient_checkpointing": "off", "liger": True},
        {"micro_batch_size": 8, "gradient_checkpointing": "on", "liger": True},
        {"micro_batch_size": 4, "gradient_checkpointing": "every_2", "liger": True},
        {"micro_batch_size": 8, "gradient_checkpointing": "on", "liger": True, "torch_compile": True},
    ]),
}
SMALL = Scenario("CPU", "tiny-llama", "2GiB", None, [
    {"micro_batch_size": 2, "gradient_checkpointing": "off"},
    {"micro_batch_size": 2, "gradient_checkpointing": "off", "liger": True},
    {"micro_batch_size": 2, "gradient_checkpointing": "off", "torch_compile": True},
])


# ----------------------------------------------------------------------------- spaces


def today_space(setup: Setup) -> dict[str, Any]:
    """The space of today's keys: micro-batch, checkpointing, allocator; stock kernels."""
    if setup.small:
        dims: dict[str, list[Any]] = {"micro_batch_size": [1, 2], "gradient_checkpointing": ["off", "on"]}
    else:
        dims = {"micro_batch_size": [1, 2, 3, 4, 6, 8, 12, 16],
                "gradient_checkpointing": ["off", "every_4", "every_2", "on"], "expandable_segments": [False, True]}
    return {"method": "lora", "fixed": {k: v for k, v in setup.common.items() if k != "method"}, "dimensions": dims}


def kernel_space(setup: Setup, attention: list[str]) -> dict[str, Any]:
    """Today's space plus the kernel dimensions (attention only over what can run here)."""
    space = today_space(setup)
    space["fixed"].pop("attn_implementation")
    space["dimensions"].update({"liger": [False, True], "torch_compile": [False, True],
                                "attn_implementation": attention})
    return space


def runnable_attention(device: str) -> list[str]:
    """sdpa always; flex_attention and flash_attention_2/3 where kernel_support says they run."""
    from types import SimpleNamespace

    from autofit.config.kernels import kernel_support

    wanted = ["sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]
    return [a for a in wanted if a == "sdpa" or kernel_support(SimpleNamespace(attn_implementation=a), device) is None]


def write_space(space: dict[str, Any], folder: Path, name: str) -> Path:
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- the CLI




def require_kernel_keys() -> None:
    """Stop with a clear message while `liger` / `torch_compile` are not `--set` keys yet."""
    text = autofit_cli("probe", "--help", timeout=120).stdout
    missing = [k for k in KERNEL_KEYS if f"  {k} " not in text]
    if missing:
        sys.exit(f"kernels_bench: `autofit probe --help` lists no key {', '.join(missing)}; wire the kernel "
                 "keys into spec.py first (the kernels wiring plan), then run this again.")


def probe(setup: Setup, model: str, limit: str, point: dict[str, Any]) -> dict[str, Any]:
    sets = [f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in {**setup.common, **point}.items()]
    args = ["probe", "--model", model, "--memory-limit", limit, "--json", "--timeout", "900", *setup.device_args]
    proc = autofit_cli(*args, *[x for s in sets for x in ("--set", s)], timeout=1200)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"outcome": "bench_error", "reason": proc.stderr[-2000:], "config": point}
    return json.loads(proc.stdout)


def search(setup: Setup, model: str, limit: str, space: Path, budget: str,
           gpu: int | None = None) -> tuple[list[ProbeResult], float, Path]:
    out = Path(tempfile.mkdtemp(prefix="kernels-bench-"))
    t0 = time.monotonic()
    where = ["--gpu", str(gpu)] if gpu is not None else setup.device_args
    proc = autofit_cli("search", "--model", model, "--space", str(space), "--memory-limit", limit, "--budget", budget,
               "--out", str(out), "--json", "--train-tokens", str(setup.train_tokens), *where,
               timeout=3 * 3600)
    wall = time.monotonic() - t0
    print(proc.stderr[-3000:], file=sys.stderr)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    run_dir = Path(summary.get("run_dir") or next(out.iterdir()))
    return [ProbeResult.from_dict(r) for r in read_trials(run_dir)], wall, run_dir


# ----------------------------------------------------------------------------- MFU


def flops_per_token(model: str, cfg: dict[str, Any]) -> float:
    """Training FLOPs per token by the formula in the module docstring."""
    shape = Shape.from_config(PRESETS[model])
    n = shape.linear_params() + shape.vocab * shape.hidden  # linear layers + output head
    ckpt = cfg.get("gradient_checkpointing", "off").split("+")[0]
    every = 0 if ckpt == "off" else 1 if ckpt == "on" else int(ckpt.split("_")[1])
    recompute = 1 / every if every else 0.0  # share of layers whose forward runs twice
    base = (4 if cfg.get("method", "lora") == "lora" else 6) + 2 * recompute
    attention = (12 + 4 * recompute) * shape.layers * shape.hidden * int(cfg.get("max_length", 2048))
    return base * n + attention


def matmul_tflops_apart() -> float | None:
    """matmul_tflops in a short-lived process: this one must hold no CUDA context while probes measure."""
    proc = subprocess.run([sys.executable, __file__, "--matmul"], capture_output=True, text=True, timeout=600,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    return float(lines[-1]) if proc.returncode == 0 and lines and lines[-1] != "None" else None


def matmul_tflops() -> float | None:
    """bf16 8192^3 matmul rate on this GPU (TFLOP/s), the practical ceiling; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12


def mfu(model: str, cfg: dict[str, Any], tokens_per_s: float | None, measured: float | None) -> dict[str, Any]:
    if not tokens_per_s:
        return {}
    achieved = tokens_per_s * flops_per_token(model, cfg) / 1e12
    return {"tflops": round(achieved, 1), "flops_per_token": flops_per_token(model, cfg),
            "mfu_vs_datasheet": round(achieved / H200_BF16_DENSE_TFLOPS, 4),
            "mfu_vs_measured_matmul": round(achieved / measured, 4) if measured else None}


# ----------------------------------------------------------------------------- profile


def profile_point(setup: Setup, model: str, limit: str, point: dict[str, Any],
                  gpu: int | None = None) -> dict[str, Any]:
    """Profile the point in a fresh process (its own CUDA context and memory cap)."""
    proc = subprocess.run([sys.executable, __file__, "--profile-point", json.dumps(point), "--model", model,
                           "--limit", limit, "--json", *(["--small"] if setup.small else [])],
                          capture_output=True, text=True, timeout=1800, check=False, env=bench_env(gpu))
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


CATEGORIES = (
    ("attention", ("flash", "attention", "sdpa", "fmha", "flex")),
    ("matmul", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "cutlass", "sm90_xmma", "nvjet")),
    ("cross-entropy / logits", ("cross_entropy", "crossentropy", "log_softmax", "nll_loss")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("norm / rope / activations", ("rms", "norm", "rope", "rotary", "silu", "swiglu", "mul", "add", "pow")),
    ("copies / casts", ("copy", "to_copy", "cat", "memcpy", "memset", "fill")),
)


def categorise(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def run_profile(setup: Setup, model: str, limit: str, point: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """Inside the profiling process: build as the probe does, train warm-up steps, profile `steps` steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from autofit.config import recipe
    from autofit.config.spec import KEYS, TrialConfig
    from autofit.core.units import parse_size

    settings = {**setup.common, **point}
    cfg = TrialConfig.from_mapping({k: v for k, v in settings.items() if k in KEYS})
    cuda = torch.cuda.is_available() and not setup.small
    if cuda:
        torch.cuda.set_per_process_memory_fraction(parse_size(limit) / torch.cuda.get_device_properties(0).total_memory)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS[model]), dtype=torch.bfloat16,
                                               attn_implementation=cfg.attn_implementation)
    net.config.use_cache = False
    net = get_peft_model(net, LoraConfig(**recipe.lora_arguments(cfg)))
    warmup = 3
    ids = torch.randint(0, PRESETS[model]["vocab_size"], ((warmup + steps) * cfg.effective_batch, cfg.max_length))
    data = [{"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)} for x in ids]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities)

    class Window(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == warmup:
                torch.cuda.synchronize() if cuda else None
                prof.start()

    with tempfile.TemporaryDirectory() as out:
        # the recipe's own arguments, kernels included (use_liger_kernel, torch_compile): what the probe ran
        targs = recipe.training_arguments(cfg, on_cpu=not cuda, max_steps=warmup + steps)
        trainer = Trainer(model=net, args=TrainingArguments(output_dir=out, disable_tqdm=True, **targs),
                          train_dataset=data, callbacks=[Window()])
        trainer.train()
        torch.cuda.synchronize() if cuda else None
        prof.stop()
    return summarise(prof, steps, "device" if cuda else "cpu")


def summarise(prof: Any, steps: int, clock: str = "device") -> dict[str, Any]:
    """Top ops by device (or, on the CPU, CPU) time per step, and the share of each category."""
    self_time = f"self_{clock}_time_total"
    events = [e for e in prof.key_averages() if getattr(e, self_time, 0) > 0]
    events.sort(key=lambda e: getattr(e, self_time), reverse=True)
    total = sum(getattr(e, self_time) for e in events) or 1
    shares: dict[str, float] = {}
    for e in events:
        cat = categorise(e.key)
        shares[cat] = shares.get(cat, 0.0) + getattr(e, self_time) / total
    top = [{"op": e.key[:120], "ms_per_step": round(getattr(e, self_time) / 1e3 / steps, 2),
            "share": round(getattr(e, self_time) / total, 4), "calls": e.count // steps} for e in events[:25]]
    return {f"{clock}_ms_per_step": round(total / 1e3 / steps, 1), "top_ops": top,
            "shares": {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}}


# ----------------------------------------------------------------------------- the exported winner


def bench_dataset(folder: Path) -> Path:
    """~400k bytes of random words (export_bench.py's): the byte tokenizer makes ~200 blocks of 2048."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]
    path = folder / "data.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": " ".join(rng.choice(words) for _ in range(180))}) + "\n" for _ in range(400))
    return path


def run_recipe(run_dir: Path, work: Path, steps: int, limit: int | None, gpu: int | None = None,
               model: Path | None = None, dataset: Path | None = None,
               patch: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Export `run_dir`'s winner (hf-trainer), run it `steps` steps (from `model`'s weights, else the run's
    model) on `dataset` (default: the bench's random words); its summary (tokens/s, peak, losses). `patch`
    rewrites the exported script first (data_parity.py: where the export lags the probe's step rule)."""
    script = work / "train.py"
    if model is None:  # a preset has no weights: its random weights with the probe's tokenizer, as a folder
        model = export_bench.model_folder(run_dir, work, dataset or bench_dataset(work))
    export = ["export", str(run_dir), "--format", "hf-trainer", "-o", str(script), "--force"]
    proc = autofit_cli(*export, *(["--dataset", str(dataset)] if dataset and (run_dir / "data").is_dir() else []),
                       timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    if patch is not None:
        script.write_text(patch(script.read_text()))
    cmd = [sys.executable, str(script), "--dataset", str(dataset or bench_dataset(work)), "--output-dir",
           str(work / "out"), "--max-steps", str(steps)]
    if limit:
        cmd += ["--emulate-memory-gib", str(limit / GIB)]
    if model is not None:
        cmd += ["--model", str(model)]
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600, env=bench_env(gpu))
    lines = [x for x in (run.stdout + run.stderr).splitlines() if x.startswith("recipe-summary ")]
    summary = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    if "max_memory_reserved" in summary:  # the probe's definition: reserved peak + memory outside the allocator
        summary["peak_bytes"] = summary["max_memory_reserved"] + max(summary["device_used"]
                                                                     - summary["memory_reserved_now"], 0)
    return {"rc": run.returncode, "wall_seconds": round(time.monotonic() - t0, 1), **summary,
            **({"stderr_tail": run.stderr[-1500:]} if run.returncode else {})}


STOCK = {"liger": False, "torch_compile": False, "attn_implementation": "sdpa"}
CURVE_VARIANTS = {
    "eager": {**STOCK, "attn_implementation": "eager"},
    "liger": {**STOCK, "liger": True},
    "flex": {**STOCK, "attn_implementation": "flex_attention"},
    "compile": {**STOCK, "torch_compile": True},
}
"""--curve-variants: recipes beside the stock one, each the winner with these kernels. `eager` is a second
correct stock kernel: its curve against the stock one is the floor two correct implementations reach
(early training on random weights moves fast, and rounding compounds); the others are one kernel each,
to say which one moves the curve."""


MERGE = """
import sys
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="auto")
PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload().save_pretrained(sys.argv[3])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[3])
"""
"""A saved model with a trained adapter merged into its weights."""


def warm_base(run_dir: Path, work: Path, steps: int, gpu: int | None, changes: dict[str, Any] = STOCK,
              dataset: Path | None = None,
              patch: Callable[[str], str] | None = None) -> tuple[Path | None, dict[str, Any]]:
    """The preset trained `steps` steps by the stock-kernel recipe, its adapter merged into the weights: a
    base whose loss has come down from ln(vocab) to where the data holds it, standing in for pretrained
    weights. From random weights the loss falls 3x in 20 steps, and a kernel recipe one step ahead of the
    stock one differs by several percent at a step without training anything else; fine-tuning starts
    from a trained model, where a kernel that computes a different loss shows as a lasting offset.
    The random preset is saved first (export_bench.model_folder: with the tokenizer the probe measured with),
    so that the warm-up and the merge read the very same weights.
    data_parity.py: the run's winner with `changes` trains on `dataset` (a run searched with --dataset),
    `patch` as run_recipe's."""
    folder = work / "warm"
    folder.mkdir()
    copy = variant_copy(run_dir, work, "warm", changes)
    base = folder / "base"

    def helper(code: str, *args: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                              check=False, timeout=1800, env=bench_env(gpu))

    try:  # the preset's random weights with the tokenizer its probe measured with (export_bench.model_folder)
        preset = export_bench.model_folder(copy, folder, dataset or bench_dataset(folder))
    except Exception as e:  # noqa: BLE001  a bench records what failed and goes on
        return None, {"steps": steps, "error": f"{type(e).__name__}: {e}"[-1500:]}
    if preset is None:
        return None, {"steps": steps, "error": "warm_base: the run's model is not a shape preset (no random weights "
                                               "to warm up)"}
    run = run_recipe(copy, folder, steps, None, gpu, preset, dataset, patch)
    summary = {"steps": steps, "losses": run.get("losses"), "rc": run.get("rc")}
    if run.get("rc") != 0:
        return None, {**summary, "error": run.get("stderr_tail") or run.get("error")}
    merged = helper(MERGE, preset, folder / "out", base)
    if merged.returncode != 0:
        return None, {**summary, "error": merged.stderr[-1500:]}
    return base, summary


def variant_copy(run_dir: Path, folder: Path, name: str, changes: dict[str, Any]) -> Path:
    """A copy of the run folder whose winner has `changes` (STOCK: the stock-kernel reference)."""
    import shutil

    copy = folder / f"{name}-run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("logs", "*.db", "*.png", "*.log"))
    best = json.loads((copy / "best.json").read_text())
    best["config"].update(changes)
    (copy / "best.json").write_text(json.dumps(best))
    return copy


def curve_diff(mine: dict[str, Any], ref: dict[str, Any]) -> float | None:
    """The largest relative difference of two recipes' logged losses at the same steps."""
    theirs = dict(ref.get("losses", []))
    rel = [abs(loss - theirs[step]) / abs(theirs[step]) for step, loss in mine.get("losses", [])
           if theirs.get(step)]
    return max(rel) if rel else None


def resumed_copy(run_dir: Path, budget: str) -> tuple[Path, dict[str, Any]]:
    """A copy of the run (the committed one stays as it was) resumed for `budget` through the CLI, and what
    the resume did: its stop reason, the best's measurements before and after."""
    import shutil

    before = ProbeResult.from_dict(json.loads((run_dir / "best.json").read_text()))
    copy = Path(tempfile.mkdtemp(prefix="kernels-resumed-")) / run_dir.name
    shutil.copytree(run_dir, copy)
    t0 = time.monotonic()
    proc = autofit_cli("search", "--resume", str(copy), "--budget", budget, "--json", timeout=3600)
    after = ProbeResult.from_dict(json.loads((copy / "best.json").read_text()))
    print(f"resumed {run_dir.name} for {budget}: rc {proc.returncode}, best {after.tokens_per_s:,.0f} tokens/s "
          f"from {len(after.measurements)} runs {after.measurements}", flush=True)
    return copy, {"budget": budget, "rc": proc.returncode, "wall_seconds": round(time.monotonic() - t0, 1),
                  "stderr_tail": proc.stderr[-2000:],
                  "best_before": {"config": config_of(before), "tokens_per_s": before.tokens_per_s,
                                  "measurements": before.measurements},
                  "best_after": {"config": config_of(after), "tokens_per_s": after.tokens_per_s,
                                 "measurements": after.measurements}}


def export_fidelity(setup: Setup, run_dir: Path, best: ProbeResult | None,
                    gpus: tuple[int | None, int | None] = (None, None),
                    keep: Callable[[dict[str, Any]], None] = lambda part: None) -> dict[str, Any]:
    """The exported winner against its probe (5% tokens/s, 3% peak) and its loss curve against stock kernels.
    `keep` gets what is measured so far after each stage, so a call cut by its time limit keeps it."""
    if best is None or not (run_dir / "best.json").is_file():
        return {"skipped": "no winner"}
    best = ProbeResult.from_dict(json.loads((run_dir / "best.json").read_text()))  # what export reads (repeats merged)
    work = Path(tempfile.mkdtemp(prefix="kernels-export-"))
    limit = best.memory_limit_bytes if not setup.small else None
    for sub in ("kernels", "stock"):
        (work / sub).mkdir()
    # the stock reference runs uncapped: with stock kernels the same micro-batch may not fit the cap
    jobs = [(run_dir, work / "kernels", limit, gpus[0]),
            (variant_copy(run_dir, work, "stock", STOCK), work / "stock", None, gpus[1])]
    if not setup.stock_reference:
        jobs = jobs[:1]
    # The search's figure is the best of noisy measurements (a launch-bound micro-batch 1 moves by
    # 10-30% between processes on a shared host): the same config probed again in this call, fresh
    # processes, gives the recipe a reference measured under the same conditions.
    limit_arg = f"{limit / GIB:g}GiB" if limit else SMALL.limit
    point = {**{k: best.config[k] for k in setup.common if k in best.config}, **config_of(best)}
    again = [probe(setup, best.model, limit_arg, point) for _ in range(setup.reprobes)]
    again_tps = [r["tokens_per_s"] for r in again if r.get("outcome") == "fit" and r.get("tokens_per_s")]
    part: dict[str, Any] = {"probe_tokens_per_s": best.tokens_per_s, "same_call_probes": again}
    keep(part)
    warm, warmed = None, None
    if setup.warm_steps and setup.stock_reference:
        warm, warmed = warm_base(run_dir, work, setup.warm_steps, gpus[1])
        keep({**part, "warm_start": warmed})
    with ThreadPoolExecutor(2 if gpus[1] is not None else 1) as pool:
        runs = pool.map(lambda j: run_recipe(j[0], j[1], setup.export_steps, j[2], j[3], warm), jobs)
        mine = next(runs)
        keep({**part, "warm_start": warmed, "recipe": mine})
        stock = next(runs, {})
    tps = mine.get("tokens_per_s", 0) / best.tokens_per_s if best.tokens_per_s and mine.get("tokens_per_s") else None
    peak = mine["peak_bytes"] / best.peak_memory_bytes if mine.get("peak_bytes") and best.peak_memory_bytes else None
    tol = TOLERANCES[best.config.get("precision", "bf16")].loss_rel
    diff = curve_diff(mine, stock)
    variants = {}
    for name in setup.curve_variants if stock else ():
        (work / name).mkdir()
        run = run_recipe(variant_copy(run_dir, work, name, CURVE_VARIANTS[name]), work / name,
                         setup.export_steps, None, gpus[1], warm)
        variants[name] = {"changes": CURVE_VARIANTS[name], "losses": run.get("losses"),
                          "tokens_per_s": run.get("tokens_per_s"), "rc": run.get("rc"),
                          "max_rel_diff_vs_stock": curve_diff(run, stock)}
    floor = (variants.get("eager") or {}).get("max_rel_diff_vs_stock")
    bound = max(tol, FLOOR_FACTOR * floor) if floor is not None else None
    same = statistics.median(again_tps) if again_tps else None
    # every measurement of the config in fresh processes: the search's own (best.json keeps them after a
    # repeat) and this call's; their median is the probe's figure least moved by one noisy process
    every = [*best.measurements, *again_tps]
    every_median = statistics.median(every) if every else None
    return {
        "steps": setup.export_steps,
        "probe_tokens_per_s": best.tokens_per_s,
        "probe_peak_bytes": best.peak_memory_bytes,
        "same_call_probes": [
            {
                k: r.get(k)
                for k in (
                    "outcome",
                    "tokens_per_s",
                    "tokens_per_s_min",
                    "tokens_per_s_max",
                    "peak_memory_bytes",
                    "reason",
                )
            }
            for r in again
        ],
        "tokens_per_s_ratio_vs_same_call_median": mine.get("tokens_per_s", 0) / same if same else None,
        "probe_measurements": every,
        "tokens_per_s_ratio_vs_every_probe_median": mine.get("tokens_per_s", 0) / every_median
        if every_median
        else None,
        "recipe": mine,
        "tokens_per_s_ratio": tps,
        "peak_ratio": peak,
        "meets_speed_and_peak": bool(tps and abs(tps - 1) <= 0.05 and peak and abs(peak - 1) <= 0.03),
        "stock_recipe": stock,
        "loss_curve_max_rel_diff": diff,
        "loss_tolerance": tol,
        "loss_curve_within_tolerance": diff is not None and diff <= tol,
        "curve_variants": variants,
        "stock_floor_max_rel_diff": floor,
        "warm_start": warmed,  # None: the curves start from the preset's random weights
        # the correctness gate's own rule (data/correctness.py): max(table, FLOOR_FACTOR x the floor
        # two correct implementations show)
        "loss_bound_with_floor": bound,
        "loss_curve_within_floor_bound": None if bound is None or diff is None else diff <= bound,
    }


# ----------------------------------------------------------------------------- the scenarios


def config_of(res: ProbeResult | dict[str, Any]) -> dict[str, Any]:
    cfg = res.config if isinstance(res, ProbeResult) else res.get("config", {})
    keep = ("micro_batch_size", "gradient_checkpointing", "expandable_segments", "attn_implementation", *KERNEL_KEYS)
    return {k: cfg[k] for k in keep if k in cfg}


def figure(model: str, res: ProbeResult | None, matmul: float | None) -> dict[str, Any] | None:
    if res is None:
        return None
    return {
        "config": config_of(res),
        "tokens_per_s": res.tokens_per_s,
        "tokens_per_s_ranked": round(speed(res)),
        "peak_gib": round(res.peak_memory_bytes / GIB, 2) if res.peak_memory_bytes else None,
        "compile_seconds": res.compile_seconds,
        "train_tokens": res.train_tokens,
        "gate": (res.extra or {}).get("gate"),
        **mfu(model, res.config, res.tokens_per_s, matmul),
    }


def verdict(
    setup: Setup,
    sc: Scenario,
    today: ProbeResult | None,
    best: ProbeResult | None,
    matmul: float | None,
    gpu: int | None = None,
) -> dict:
    """Ratio by the objective's speed (compile seconds amortised over the planned training length)."""
    ratio = speed(best) / speed(today) if today and best and speed(today) else None
    out = {
        "today": figure(sc.model, today, matmul),
        "with_kernels": figure(sc.model, best, matmul),
        "ratio": round(ratio, 3) if ratio else None,
        "target": sc.target,
        "met": None if sc.target is None or ratio is None else ratio >= sc.target,
    }
    if out["met"] is False and best is not None:
        out["profile_of_winner"] = profile_point(setup, sc.model, sc.limit, {**config_of(best)}, gpu)
    return out


def keep_run(run_dir: Path, keep: str | None, name: str) -> None:
    """Copy a run folder under `keep` (its logs left out: the trials, the study, best.json, the report)."""
    if keep:
        import shutil

        shutil.copytree(
            run_dir, Path(keep) / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("logs", ".standby*")
        )


def run_searches(
    setup: Setup,
    sc: Scenario,
    budget: str,
    folder: Path,
    matmul: float | None,
    gpus: tuple[int | None, int | None] = (None, None),
    keep: str | None = None,
) -> dict[str, Any]:
    """Today's space and the extended one, one after the other, or at once on two GPUs."""
    attention = runnable_attention("cpu" if setup.small else "cuda")
    spaces = [
        write_space(today_space(setup), folder, f"{sc.name}-today"),
        write_space(kernel_space(setup, attention), folder, f"{sc.name}-kernels"),
    ]
    with ThreadPoolExecutor(2 if gpus[0] is not None else 1) as pool:
        (today_rows, today_wall, today_dir), (k_rows, k_wall, k_dir) = pool.map(
            lambda i: search(setup, sc.model, sc.limit, spaces[i], budget, gpus[i]), (0, 1)
        )
    keep_run(today_dir, keep, f"{sc.name}-today")
    keep_run(k_dir, keep, f"{sc.name}-kernels")
    best = best_of(k_rows)
    out = verdict(setup, sc, best_of(today_rows), best, matmul, gpus[1])
    mism = [config_of(r) for r in k_rows if r.outcome.value == "mismatch"]
    out.update(
        {
            "attention_searched": attention,
            "search_wall_seconds": {"today": today_wall, "kernels": k_wall},
            "probes": {"today": len(today_rows), "kernels": len(k_rows)},
            "mismatches": mism,
            "outcomes_with_kernels": [
                {
                    "config": config_of(r),
                    "outcome": r.outcome.value,
                    "reason": r.reason,
                    "tokens_per_s": r.tokens_per_s,
                    "compile_seconds": r.compile_seconds,
                }
                for r in k_rows
            ],
            "run_dirs": {"today": str(today_dir), "kernels": str(k_dir)},
            "export": export_fidelity(setup, k_dir, best, gpus)
            if setup.export_steps
            else {"skipped": "--export-steps 0"},
        }
    )
    return out


def run_probes(setup: Setup, sc: Scenario, matmul: float | None) -> dict[str, Any]:
    rows = []
    for point in sc.points:
        d = probe(setup, sc.model, sc.limit, point)
        rows.append(d)
        print(sc.name, point, d.get("outcome"), d.get("tokens_per_s"), d.get("reason", "")[:200], flush=True)
    results = [ProbeResult.from_dict(d) for d in rows if d.get("outcome") != "bench_error"]
    today = best_of([r for r in results if not any(r.config.get(k) for k in KERNEL_KEYS)])
    out = verdict(setup, sc, today, best_of(results), matmul)
    out["points"] = [
        {
            "config": p,
            "outcome": d.get("outcome"),
            "reason": d.get("reason", "")[:500],
            "tokens_per_s": d.get("tokens_per_s"),
            "compile_seconds": d.get("compile_seconds"),
            "peak_gib": round(d["peak_memory_bytes"] / GIB, 2) if d.get("peak_memory_bytes") else None,
        }
        for p, d in zip(sc.points, rows, strict=True)
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("search", "probes"), default="search")
    ap.add_argument("--scenarios", default="S1,S2,S4")
    ap.add_argument("--budget", default="20m", help="per search (two searches per scenario)")
    ap.add_argument("--small", action="store_true", help="tiny-llama on the CPU: the plumbing, no GPU figures")
    ap.add_argument(
        "--train-tokens",
        type=int,
        default=TRAIN_TOKENS,
        help=f"planned training length compile time is amortised over (default {TRAIN_TOKENS:,})",
    )
    ap.add_argument("--export-steps", type=int, default=50, help="steps of the exported winner (0: skip the export)")
    ap.add_argument(
        "--gpus",
        default="",
        help="comma-separated GPU indices, two a scenario: its two searches (and "
        "the exported recipes) run at once, every scenario at once",
    )
    ap.add_argument("--profile-point", help="JSON of one point: profile it and print the table")
    ap.add_argument("--matmul", action="store_true", help="print this GPU's bf16 matmul TFLOP/s and exit")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--limit", default="40GiB")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--name", help="result file name (default kernels-<mode>)")
    ap.add_argument("--keep", help="copy every search's run folder here (logs left out)")
    ap.add_argument(
        "--reprobes",
        type=int,
        default=2,
        help="with the export: probe the winner again this many times in the same call (default 2)",
    )
    ap.add_argument(
        "--no-stock-reference",
        action="store_true",
        help="export fidelity without the stock-kernel recipe's loss curve (speed and peak only)",
    )
    ap.add_argument(
        "--curve-variants",
        default="",
        help=f"with the export: more recipes for the loss curve, comma-separated of "
        f"{', '.join(CURVE_VARIANTS)} (eager: the floor two correct stock kernels reach)",
    )
    ap.add_argument("--export-run", help="a kernel search's run folder (from --keep): only its export fidelity")
    ap.add_argument(
        "--resume-first",
        metavar="DURATION",
        help="with --export-run: resume a copy of the run for this long first (`autofit search --resume`), "
        "so a best measured once is measured again and its figure is a median; then the export",
    )
    ap.add_argument(
        "--winner-changes",
        metavar="JSON",
        help="with --export-run: export the run's winner with these config changes (a copy of the run, "
        "as the stock reference is made), e.g. the best a resume of the run found",
    )
    ap.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="with the export: start the loss curves from the preset trained this many steps by the "
        "stock recipe (a settled loss, as fine-tuning a trained model), not from random weights",
    )
    a = ap.parse_args()
    unknown = {x.strip() for x in a.curve_variants.split(",") if x.strip()} - set(CURVE_VARIANTS)
    if unknown:
        ap.error(
            f"--curve-variants: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(CURVE_VARIANTS)}"
        )
    setup = Setup(
        small=a.small,
        train_tokens=a.train_tokens,
        export_steps=a.export_steps,
        stock_reference=not a.no_stock_reference,
        reprobes=a.reprobes,
        curve_variants=tuple(x.strip() for x in a.curve_variants.split(",") if x.strip()),
        warm_steps=a.warm_steps,
        gpus=tuple(int(g) for g in a.gpus.split(",") if g.strip()),
    )
    if a.matmul:
        print(matmul_tflops())
        return
    if a.profile_point:
        res = run_profile(setup, a.model, a.limit, json.loads(a.profile_point))
        print(json.dumps(res) if a.json else json.dumps(res, indent=1))
        return
    name = a.name or f"kernels-{a.mode}" + ("-small-cpu" if a.small else "")
    if a.export_run:
        run_dir = Path(a.export_run)
        head: dict[str, Any] = {"export_of": run_dir.name}
        if a.resume_first:
            run_dir, head["resumed"] = resumed_copy(run_dir, a.resume_first)
        if a.winner_changes:
            head["winner_changes"] = json.loads(a.winner_changes)
            run_dir = variant_copy(
                run_dir, Path(tempfile.mkdtemp(prefix="kernels-changed-")), "changed", head["winner_changes"]
            )
        best = ProbeResult.from_dict(json.loads((run_dir / "best.json").read_text()))
        head["winner"] = config_of(best)
        export = export_fidelity(
            setup, run_dir, best, keep=lambda part: save(name, {**head, "export": part, "complete": False})
        )
        save(name, {**head, "export": export, "complete": True})
        return
    require_kernel_keys()
    matmul = None if a.small else matmul_tflops_apart()
    folder = Path(tempfile.mkdtemp(prefix="kernels-spaces-"))
    chosen = [SMALL] if a.small else [SCENARIOS[n.strip()] for n in a.scenarios.split(",")]

    scenarios: dict[str, Any] = {}

    def write() -> None:
        save(
            name,
            {
                "mode": a.mode,
                "small": a.small,
                "budget_per_search": a.budget if a.mode == "search" else None,
                "gpus": list(setup.gpus),
                "matmul_tflops_measured": matmul,
                "datasheet_tflops": H200_BF16_DENSE_TFLOPS,
                "train_tokens_for_amortisation": a.train_tokens,
                "mfu_formula": __doc__.split("MFU (stated with every figure):")[1].strip(),
                "scenarios": dict(scenarios),
            },
        )

    def one(i: int) -> dict[str, Any]:
        sc = chosen[i]
        out = (
            run_searches(setup, sc, a.budget, folder, matmul, setup.gpu_pair(i), a.keep)
            if a.mode == "search"
            else run_probes(setup, sc, matmul)
        )
        print(sc.name, json.dumps({k: out[k] for k in ("ratio", "target", "met")}), flush=True)
        scenarios[sc.name] = out
        write()  # after every scenario: a call cut short keeps what it measured
        return out

    parallel = a.mode == "search" and setup.gpu_pair(len(chosen) - 1)[0] is not None
    with ThreadPoolExecutor(len(chosen) if parallel else 1) as pool:
        list(pool.map(one, range(len(chosen))))


if __name__ == "__main__":
    main()
