"""Issue 13's GPU evidence: full fine-tuning across the GPUs of one host, the search against a grid.

For each GPU count N (--gpus-list, default 2,4), full fine-tuning of the Llama-2-7B shape at length
2048 with every GPU capped at --limit (40 GiB: the A100-40G class), through the real CLI:
1. the grid: engine (none = DDP, fsdp2, zero2, zero3) x its host offload x micro-batch (1, 2, 4, 8),
   checkpointing on (FSDP's own for fsdp2), each point one `autofit probe --gpus N` (a torchrun group);
   zero2/zero3 are `unsupported` where deepspeed is not installed, and the file says so;
2. `autofit search --gpus N --space distributed --budget B`: its best against the grid's best (>= 0.97);
3. the common recipe, ZeRO-3 at micro-batch 1 (FSDP2 full-shard at micro-batch 1 where deepspeed is
   missing: the same sharding), against the search's best;
4. the search's winner exported (hf-trainer) and run for --export-steps steps with torchrun: tokens/s
   within 5% and peak within 3% of its probe.
Every grid point is written as it is measured (`--resume FILE` continues a grid cut short by a call's
time limit). `--small` runs the same pipeline with tiny-llama as two gloo processes on the CPU: the
plumbing, no GPU figures.

    python bench/multigpu_bench.py --gpus-list 2 --budget 8m        # on an nvidia-h200-x2
    python bench/multigpu_bench.py --gpus-list 2,4 --budget 8m      # on an nvidia-h200-x4
    python bench/multigpu_bench.py --small --budget 90s             # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (  # also puts the checkout on sys.path
    autofit_cli,
    bench_env,
    out_dir,
    read_trials,
    save,
)

from autofit.config.spec import ENGINES, OFFLOADS_BY_ENGINE

MICRO_BATCHES = (1, 2, 4, 8)
COMMON = {"method": "full", "max_length": 2048, "global_batch": 16, "precision": "bf16",
          "optimizer": "adamw_torch_fused", "gradient_checkpointing": "on"}
SMALL = {"method": "full", "max_length": 64, "global_batch": 8, "precision": "fp32",
         "optimizer": "adamw_torch", "gradient_checkpointing": "on"}


def grid_points(small: bool) -> list[dict[str, Any]]:
    """engine x offload x micro-batch (reshard after forward on: FSDP2's full shard)."""
    mbs = (1, 2) if small else MICRO_BATCHES
    engines = ("none", "fsdp2") if small else ENGINES
    return [{"engine": e, "cpu_offload": o, "micro_batch_size": mb}
            for e in engines for o in OFFLOADS_BY_ENGINE[e] if not (small and o != "off")
            for mb in mbs]


def where(n: int, small: bool) -> list[str]:
    return ["--device", "cpu", "--gpus", str(n)] if small else ["--gpus", str(n), "--gpu", ",".join(map(str, range(n)))]


def probe(model: str, limit: str | None, n: int, small: bool, point: dict[str, Any]) -> dict[str, Any]:
    sets = {**(SMALL if small else COMMON), **point}
    args = ["probe", "--model", model, "--json", "--timeout", "900", *where(n, small)]
    args += ["--memory-limit", limit] if limit else []
    proc = autofit_cli(
        *args, *itertools.chain.from_iterable(("--set", f"{k}={v}") for k, v in sets.items()), timeout=1200
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"outcome": "bench_error", "reason": proc.stderr[-2000:], "point": point}
    r = json.loads(proc.stdout)
    return {
        "point": point,
        "outcome": r["outcome"],
        "tokens_per_s": r["tokens_per_s"],
        "peak_memory_bytes": r["peak_memory_bytes"],
        "reason": r["reason"][:300],
        "wall_seconds": r["wall_seconds"],
        "ranks": r["extra"].get("ranks"),
    }


def grid(
    model: str, limit: str | None, n: int, small: bool, done: list[dict[str, Any]], path: Path, deadline: float
) -> list[dict[str, Any]]:
    """Every grid point not in `done`, written to `path` after each (a later call resumes)."""
    seen = [d["point"] for d in done]
    for point in grid_points(small):
        if point in seen or time.monotonic() > deadline:
            continue
        done.append(probe(model, limit, n, small, point))
        path.write_text(json.dumps(done, indent=1))
        print(f"grid N={n}: {point} -> {done[-1]['outcome']} {done[-1].get('tokens_per_s')}", file=sys.stderr)
    return done


def search(model: str, limit: str | None, n: int, small: bool, budget: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="multigpu-bench-"))
    space = "cpu-distributed.yaml" if small else "distributed"
    if small:
        space = str(out / space)
        Path(space).write_text(
            json.dumps({"fixed": SMALL, "dimensions": {"engine": ["none", "fsdp2"], "micro_batch_size": [1, 2]}})
        )
    t0 = time.monotonic()
    args = [
        "search",
        "--model",
        model,
        "--space",
        space,
        "--budget",
        budget,
        "--out",
        str(out),
        "--json",
        "--confirm",
        "0" if small else "2",
        *where(n, small),
    ]
    proc = autofit_cli(*args, *(["--memory-limit", limit] if limit else []), timeout=3 * 3600)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    run_dir = Path(summary["run_dir"]) if summary.get("run_dir") else None
    return {
        "wall_seconds": round(time.monotonic() - t0, 1),
        "rc": proc.returncode,
        "run_dir": str(run_dir),
        "best": summary.get("best"),
        "probes": len(read_trials(run_dir)) if run_dir else 0,
        "stderr_tail": proc.stderr[-1500:],
    }


def run_recipe(run_dir: Path, n: int, steps: int, small: bool) -> dict[str, Any]:
    """The winner exported (hf-trainer) and run `steps` steps with torchrun on N ranks."""
    work = Path(tempfile.mkdtemp(prefix="multigpu-export-"))
    script = work / "train.py"
    proc = autofit_cli("export", str(run_dir), "--format", "hf-trainer", "-o", str(script), "--force", timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(["token"] * 400)}) + "\n" for _ in range(400)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(script),
        "--dataset",
        str(data),
        "--output-dir",
        str(work / "out"),
        "--max-steps",
        str(steps),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600, env=bench_env())
    lines = [x for x in (run.stdout + run.stderr).splitlines() if x.startswith("recipe-summary ")]
    summary = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    return {"rc": run.returncode, **summary, **({"stderr_tail": run.stderr[-1500:]} if run.returncode else {})}


def one_count(args: argparse.Namespace, n: int, resume: list[dict[str, Any]], deadline: float) -> dict[str, Any]:
    model = "tiny-llama" if args.small else args.model
    limit = None if args.small else args.limit
    path = out_dir() / f"multigpu-grid-{n}.json"
    points = grid(model, limit, n, args.small, list(resume), path, deadline)
    fits = [p for p in points if p["outcome"] == "fit"]
    grid_best = max(fits, key=lambda p: p["tokens_per_s"]) if fits else None
    s = search(model, limit, n, args.small, args.budget)
    best = s["best"]
    ratio = best["tokens_per_s"] / grid_best["tokens_per_s"] if best and grid_best else None
    common = next(
        (
            p
            for p in points
            if p["point"] == {"engine": "zero3", "cpu_offload": "off", "micro_batch_size": 1} and p["outcome"] == "fit"
        ),
        None,
    ) or next(
        (p for p in points if p["point"] == {"engine": "fsdp2", "cpu_offload": "off", "micro_batch_size": 1}), None
    )
    out = {
        "gpus": n,
        "grid": points,
        "grid_complete": len(points) == len(grid_points(args.small)),
        "grid_best": grid_best,
        "search": s,
        "search_vs_grid": ratio,
        "meets_0_97": bool(ratio and ratio >= 0.97),
        "common_recipe": common,
        "best_vs_common": best["tokens_per_s"] / common["tokens_per_s"]
        if best and common and common.get("tokens_per_s")
        else None,
    }
    if best and args.export_steps:
        rec = run_recipe(Path(s["run_dir"]), n, args.export_steps, args.small)
        tps, peak = rec.get("tokens_per_s"), rec.get("peak_bytes")
        out["export"] = {
            **rec,
            "tokens_per_s_ratio": tps / best["tokens_per_s"] if tps else None,
            "peak_ratio": peak / best["peak_memory_bytes"] if peak and best.get("peak_memory_bytes") else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus-list", default="2,4", help="GPU counts, one grid and one search each")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--limit", default="40GiB", help="memory limit per GPU")
    ap.add_argument("--budget", default="8m", help="per search")
    ap.add_argument("--export-steps", type=int, default=50)
    ap.add_argument("--grid-seconds", type=float, default=3600, help="stop adding grid points after this")
    ap.add_argument("--resume", nargs="*", default=[], help="multigpu-grid-N.json files of an earlier call")
    ap.add_argument("--small", action="store_true", help="tiny-llama, two gloo processes on the CPU")
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    counts = [2] if args.small else [int(x) for x in args.gpus_list.split(",")]
    resumed = {int(Path(f).stem.rsplit("-", 1)[1]): json.loads(Path(f).read_text()) for f in args.resume}
    deadline = time.monotonic() + args.grid_seconds
    results = [one_count(args, n, resumed.get(n, []), deadline) for n in counts]
    save(
        args.name or ("multigpu-small" if args.small else "multigpu-bench"),
        {
            "model": "tiny-llama" if args.small else args.model,
            "limit": None if args.small else args.limit,
            "counts": results,
        },
    )


if __name__ == "__main__":
    main()
