"""Issue 12's GPU evidence: today's best config against the best with kernels, measured in one run.

Scenarios (SCENARIOS.md): S1 Llama-2-7B shape at 40 GiB, S2 the same at 24 GiB, S4 Qwen2.5-7B
shape (vocab 152,064) at 24 GiB; LoRA r16 on q_proj,v_proj, bf16, length 2048, global batch 16.
Targets: >= 1.10x on S1, >= 1.25x on S4. Where one is missed, a torch.profiler table of the
winner's step says where the time goes.

Two modes, both through the real CLI (subprocesses, as a user runs it):
- `--mode search` (default): `autofit search` over today's space and over the same space
  extended with `liger`, `torch_compile` and `attn_implementation`, one after the other, with
  the same budget; the ratio is best(kernels) / best(today).
- `--mode probes`: `autofit probe` on a short list of points chosen from the hand measurements
  (SCENARIOS.md, 2026-12-03): cheap, and a check on what the search found.

    python bench/kernels_bench.py --budget 20m                 # S1, S2, S4 searches
    python bench/kernels_bench.py --mode probes --scenarios S1,S4
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
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import GIB, read_trials, save

from autofit.memory import Shape
from autofit.models import PRESETS
from autofit.objective import best_of
from autofit.result import ProbeResult

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


# ----------------------------------------------------------------------------- spaces


def today_space(sc: Scenario) -> dict[str, Any]:
    """The space of today's keys: micro-batch, checkpointing, allocator; stock kernels."""
    return {"method": "lora", "fixed": {k: v for k, v in COMMON.items() if k != "method"},
            "dimensions": {"micro_batch_size": [1, 2, 3, 4, 6, 8, 12, 16],
                           "gradient_checkpointing": ["off", "every_4", "every_2", "on"],
                           "expandable_segments": [False, True]}}


def kernel_space(sc: Scenario, attention: list[str]) -> dict[str, Any]:
    """Today's space plus the kernel dimensions (attention only over what can run here)."""
    space = today_space(sc)
    space["fixed"].pop("attn_implementation")
    space["dimensions"].update({"liger": [False, True], "torch_compile": [False, True],
                                "attn_implementation": attention})
    return space


def runnable_attention() -> list[str]:
    """sdpa always; flex_attention and flash_attention_2/3 where kernel_support says they run."""
    from types import SimpleNamespace

    from autofit.kernels import kernel_support

    wanted = ["sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]
    return [a for a in wanted if kernel_support(SimpleNamespace(attn_implementation=a), "cuda") is None]


def write_space(space: dict[str, Any], folder: Path, name: str) -> Path:
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- the CLI


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def require_kernel_keys() -> None:
    """Stop with a clear message while `liger` / `torch_compile` are not `--set` keys yet."""
    text = cli("probe", "--help", timeout=120).stdout
    missing = [k for k in KERNEL_KEYS if f"  {k} " not in text]
    if missing:
        sys.exit(f"kernels_bench: `autofit probe --help` lists no key {', '.join(missing)}; wire the kernel "
                 "keys into spec.py first (the kernels wiring plan), then run this again.")


def probe(model: str, limit: str, point: dict[str, Any]) -> dict[str, Any]:
    sets = [f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in {**COMMON, **point}.items()]
    args = ["probe", "--model", model, "--memory-limit", limit, "--json", "--timeout", "900"]
    proc = cli(*args, *[x for s in sets for x in ("--set", s)], timeout=1200)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"outcome": "bench_error", "reason": proc.stderr[-2000:], "config": point}
    return json.loads(proc.stdout)


def search(model: str, limit: str, space: Path, budget: str) -> tuple[list[ProbeResult], float, Path]:
    out = Path(tempfile.mkdtemp(prefix="kernels-bench-"))
    t0 = time.monotonic()
    proc = cli("search", "--model", model, "--space", str(space), "--memory-limit", limit, "--budget", budget,
               "--out", str(out), "--json", timeout=3 * 3600)
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


def profile_point(model: str, limit: str, point: dict[str, Any]) -> dict[str, Any]:
    """Profile the point in a fresh process (its own CUDA context and memory cap)."""
    proc = subprocess.run([sys.executable, __file__, "--profile-point", json.dumps(point), "--model", model,
                           "--limit", limit, "--json"], capture_output=True, text=True, timeout=1800, check=False)
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


def run_profile(model: str, limit: str, point: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """Inside the profiling process: build as the probe does, train warm-up steps, profile `steps` steps."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from autofit import kernels, recipe
    from autofit.spec import KEYS, TrialConfig
    from autofit.units import parse_size

    settings = {**COMMON, **point}
    cfg = TrialConfig.from_mapping({k: v for k, v in settings.items() if k in KEYS})
    flags = argparse.Namespace(**{k: bool(settings.get(k, False)) for k in KERNEL_KEYS})
    torch.cuda.set_per_process_memory_fraction(parse_size(limit) / torch.cuda.get_device_properties(0).total_memory)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS[model]), dtype=torch.bfloat16,
                                               attn_implementation=cfg.attn_implementation)
    net.config.use_cache = False
    from peft import LoraConfig, get_peft_model

    net = get_peft_model(net, LoraConfig(**recipe.lora_arguments(cfg)))
    warmup = 3
    ids = torch.randint(0, PRESETS[model]["vocab_size"], ((warmup + steps) * cfg.effective_batch, cfg.max_length))
    data = [{"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)} for x in ids]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])

    class Window(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == warmup:
                torch.cuda.synchronize()
                prof.start()

    with tempfile.TemporaryDirectory() as out:
        targs = {**recipe.training_arguments(cfg, on_cpu=False, max_steps=warmup + steps),
                 **kernels.training_arguments(flags)}
        trainer = Trainer(model=net, args=TrainingArguments(output_dir=out, disable_tqdm=True, **targs),
                          train_dataset=data, callbacks=[Window()])
        trainer.train()
        torch.cuda.synchronize()
        prof.stop()
    return summarise(prof, steps)


def summarise(prof: Any, steps: int) -> dict[str, Any]:
    """Top CUDA ops by device time per step, and the share of each category."""
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1
    shares: dict[str, float] = {}
    for e in events:
        cat = categorise(e.key)
        shares[cat] = shares.get(cat, 0.0) + e.self_device_time_total / total
    top = [{"op": e.key[:120], "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 2),
            "share": round(e.self_device_time_total / total, 4), "calls": e.count // steps} for e in events[:25]]
    return {"device_ms_per_step": round(total / 1e3 / steps, 1), "top_ops": top,
            "shares": {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}}


# ----------------------------------------------------------------------------- the scenarios


def config_of(res: ProbeResult | dict[str, Any]) -> dict[str, Any]:
    cfg = res.config if isinstance(res, ProbeResult) else res.get("config", {})
    keep = ("micro_batch_size", "gradient_checkpointing", "expandable_segments", "attn_implementation", *KERNEL_KEYS)
    return {k: cfg[k] for k in keep if k in cfg}


def figure(model: str, res: ProbeResult | None, matmul: float | None) -> dict[str, Any] | None:
    if res is None:
        return None
    extra = res.extra or {}
    compile_s = extra.get("compile_seconds") or getattr(res, "compile_seconds", None)
    out = {"config": config_of(res), "tokens_per_s": res.tokens_per_s,
           "peak_gib": round(res.peak_memory_bytes / GIB, 2) if res.peak_memory_bytes else None,
           "compile_seconds": compile_s, **mfu(model, res.config, res.tokens_per_s, matmul)}
    if compile_s and res.tokens_per_s:
        from autofit.kernels import amortised_tokens_per_s

        out["tokens_per_s_amortised"] = round(amortised_tokens_per_s(res.tokens_per_s, compile_s, TRAIN_TOKENS))
    return out


def verdict(sc: Scenario, today: ProbeResult | None, best: ProbeResult | None, matmul: float | None) -> dict:
    ratio = (best.tokens_per_s / today.tokens_per_s) if today and best and today.tokens_per_s else None
    out = {"today": figure(sc.model, today, matmul), "with_kernels": figure(sc.model, best, matmul),
           "ratio": round(ratio, 3) if ratio else None, "target": sc.target,
           "met": None if sc.target is None or ratio is None else ratio >= sc.target}
    if out["met"] is False and best is not None:
        out["profile_of_winner"] = profile_point(sc.model, sc.limit, {**config_of(best)})
    return out


def run_searches(sc: Scenario, budget: str, folder: Path, matmul: float | None) -> dict[str, Any]:
    attention = runnable_attention()
    today_rows, today_wall, today_dir = search(sc.model, sc.limit, write_space(today_space(sc), folder,
                                               f"{sc.name}-today"), budget)
    k_rows, k_wall, k_dir = search(sc.model, sc.limit, write_space(kernel_space(sc, attention), folder,
                                   f"{sc.name}-kernels"), budget)
    out = verdict(sc, best_of(today_rows), best_of(k_rows), matmul)
    mism = [config_of(r) for r in k_rows if r.outcome.value == "mismatch"]
    out.update({"attention_searched": attention, "search_wall_seconds": {"today": today_wall, "kernels": k_wall},
                "probes": {"today": len(today_rows), "kernels": len(k_rows)}, "mismatches": mism,
                "outcomes_with_kernels": [{"config": config_of(r), "outcome": r.outcome.value, "reason": r.reason,
                                           "tokens_per_s": r.tokens_per_s} for r in k_rows],
                "run_dirs": {"today": str(today_dir), "kernels": str(k_dir)}})
    return out


def run_probes(sc: Scenario, matmul: float | None) -> dict[str, Any]:
    rows = []
    for point in sc.points:
        d = probe(sc.model, sc.limit, point)
        rows.append(d)
        print(sc.name, point, d.get("outcome"), d.get("tokens_per_s"), d.get("reason", "")[:200], flush=True)
    results = [ProbeResult.from_dict(d) for d in rows if d.get("outcome") != "bench_error"]
    today = best_of([r for r in results if not any(r.config.get(k) for k in KERNEL_KEYS)])
    out = verdict(sc, today, best_of(results), matmul)
    out["points"] = [{"config": p, "outcome": d.get("outcome"), "reason": d.get("reason", "")[:500],
                      "tokens_per_s": d.get("tokens_per_s"), "peak_gib": round(d["peak_memory_bytes"] / GIB, 2)
                      if d.get("peak_memory_bytes") else None} for p, d in zip(sc.points, rows)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("search", "probes"), default="search")
    ap.add_argument("--scenarios", default="S1,S2,S4")
    ap.add_argument("--budget", default="20m", help="per search (two searches per scenario)")
    ap.add_argument("--profile-point", help="JSON of one point: profile it and print the table")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--limit", default="40GiB")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.profile_point:
        res = run_profile(a.model, a.limit, json.loads(a.profile_point))
        print(json.dumps(res) if a.json else json.dumps(res, indent=1))
        return
    require_kernel_keys()
    matmul = matmul_tflops()
    folder = Path(tempfile.mkdtemp(prefix="kernels-spaces-"))
    scenarios = {}
    for name in a.scenarios.split(","):
        sc = SCENARIOS[name.strip()]
        scenarios[sc.name] = run_searches(sc, a.budget, folder, matmul) if a.mode == "search" \
            else run_probes(sc, matmul)
        print(sc.name, json.dumps({k: scenarios[sc.name][k] for k in ("ratio", "target", "met")}), flush=True)
    save(f"kernels-{a.mode}", {"mode": a.mode, "budget_per_search": a.budget if a.mode == "search" else None,
                               "matmul_tflops_measured": matmul, "datasheet_tflops": H200_BF16_DENSE_TFLOPS,
                               "train_tokens_for_amortisation": TRAIN_TOKENS,
                               "mfu_formula": __doc__.split("MFU (stated with every figure):")[1].strip(),
                               "scenarios": scenarios})


if __name__ == "__main__":
    main()
