"""Issue 11's figures in one call: the data-aware search on real and synthetic data.

For each scenario (S1: 40 GiB, S2: 24 GiB; Llama-2-7B shape, LoRA, length 2048) and each dataset
(D1: the standard library's docstrings; D2: log-normal lengths, mean ~300, p99 ~2,000; both built
by bench/data/make_corpus.py), one `autofit search --dataset` run; from its probes:
- the winner vs the best `pad_longest` fit (dynamic padding: what most recipes do) and vs the best
  `pad_max` fit (today's probe), in trained tokens/s, with the ratios (target: >= 1.3x over
  pad_longest where the mean sample is <= 1/3 of max_length);
then for the first scenario's winner on each dataset:
- the exported hf-trainer recipe trained `--steps` optimizer steps on the same data under the same
  limit (`--emulate-memory-gib`): no OOM, trained tokens/s within 7% of the probe, peak <= the probe's
  worst-case peak + 3%;
- the same recipe on a file of only the longest samples (every micro-batch as heavy as the data can
  make it): it must stay inside the limit.

    python bench/data_bench.py                 # on the GPU: S1, S2 x D1, D2 (~9 minutes)
    python bench/data_bench.py --small         # on the CPU: tiny-llama, the committed slices, length 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import GIB, REPO, bench_env, out_dir, read_trials, save

SLICES = {"D1": REPO / "tests" / "data" / "d1-slice.jsonl", "D2": REPO / "tests" / "data" / "d2-slice.jsonl"}
DATA_SPACE = """\
# The data-aware benchmark space: S1/S2's shape; `batching` is added by --dataset.
method: lora
fixed:
  global_batch: {gb}
  lora_r: {r}
  lora_alpha: {alpha}
  lora_targets: q_proj,v_proj
  precision: {prec}
  optimizer: {opt}
  attn_implementation: sdpa
dimensions:
  micro_batch_size: {mbs}
  gradient_checkpointing: {ckpt}
"""
FULL = {"model": "llama2-7b", "limits": ["40GiB", "24GiB"], "max_length": 2048, "gb": 16, "r": 16, "alpha": 32,
        "prec": "bf16", "opt": "adamw_torch_fused", "mbs": "[1, 2, 4, 8]", "ckpt": "[off, on]", "budget": "100s",
        "device": []}
SMALL = {"model": "tiny-llama", "limits": [None], "max_length": 128, "gb": 4, "r": 8, "alpha": 16, "prec": "fp32",
         "opt": "adamw_torch", "mbs": "[2]", "ckpt": "[off]", "budget": "150s", "device": ["--device", "cpu"]}


def corpora(small: bool, work: Path) -> dict[str, Path]:
    if small:
        return dict(SLICES)
    subprocess.run([sys.executable, str(REPO / "bench" / "data" / "make_corpus.py"), "--out", str(work)], check=True)
    return {"D1": work / "d1.jsonl", "D2": work / "d2.jsonl"}


def seconds(budget: str) -> float:
    return float(budget.rstrip("s")) * (60 if budget.endswith("m") else 1)


def search(s: dict[str, Any], space: Path, data: Path, limit: str | None, runs: Path) -> tuple[Path | None, str]:
    cmd = [sys.executable, "-m", "autofit", "search", "--model", s["model"], "--space", str(space), "--dataset",
           str(data), "--max-length", str(s["max_length"]), "--budget", s["budget"], "--confirm", "0", "--out",
           str(runs), "--json", *s["device"], *(["--memory-limit", limit] if limit else [])]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=bench_env(), cwd=REPO,
                              timeout=seconds(s["budget"]) + 120)
    except subprocess.TimeoutExpired:
        return None, "the search overran its budget by 120 s"
    try:
        return Path(json.loads(proc.stdout)["run_dir"]), proc.stderr[-1500:]
    except (json.JSONDecodeError, KeyError):
        return None, proc.stderr[-3000:]


def compare(run: Path) -> dict[str, Any]:
    """The winner against the best pad_longest and pad_max fits of the same run."""
    rows = [r for r in read_trials(run) if r["outcome"] == "fit" and r.get("tokens_per_s")]
    best = {}
    for r in rows:
        b = r["config"].get("batching", "pad_max")
        if b not in best or r["tokens_per_s"] > best[b]["tokens_per_s"]:
            best[b] = r
    data = json.loads((run / "data" / "data.json").read_text())
    win = json.loads((run / "best.json").read_text())

    def ratio(b: str) -> float | None:
        return win["tokens_per_s"] / best[b]["tokens_per_s"] if b in best else None

    return {"run": run.name, "winner": {k: win[k] for k in ("config", "tokens_per_s", "peak_memory_bytes", "extra")},
            "best_by_batching": {b: {"tokens_per_s": r["tokens_per_s"], "peak_memory_bytes": r["peak_memory_bytes"],
                                     "config": r["config"], "pad_fraction": r.get("extra", {}).get("pad_fraction")}
                                 for b, r in best.items()},
            "ratio_vs_pad_longest": ratio("pad_longest"), "ratio_vs_pad_max": ratio("pad_max"),
            "mean_sample": data["mean"], "percentiles": data["percentiles"], "approximate": data["approximate"],
            "probes": len(read_trials(run))}


def fill(s: dict[str, Any], run: Path, data: Path, limit: str | None) -> dict[str, Any]:
    """The winner's config with pad_longest and pad_max, probed where the search measured neither (its
    budget may end first): the same config, only the batching changed."""
    win = json.loads((run / "best.json").read_text())["config"]
    measured = {r["config"].get("batching") for r in read_trials(run) if r["outcome"] == "fit"}
    out = {}
    for batching in ("pad_longest", "pad_max"):
        if batching in measured:
            continue
        sets = [x for k in ("method", "max_length", "micro_batch_size", "global_batch", "precision",
                            "gradient_checkpointing", "optimizer", "attn_implementation", "lora_r", "lora_alpha",
                            "lora_targets") for x in ("--set", f"{k}={win[k]}")]
        cmd = [sys.executable, "-m", "autofit", "probe", "--model", s["model"], "--dataset", str(data), "--json",
               *sets, "--set", f"batching={batching}", *s["device"], "--log-dir", str(run / "logs"),
               *(["--memory-limit", limit] if limit else [])]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=bench_env(), cwd=REPO, timeout=600)
        try:
            res = json.loads(proc.stdout)
            out[batching] = {"outcome": res["outcome"], "tokens_per_s": res["tokens_per_s"],
                             "peak_memory_bytes": res["peak_memory_bytes"], "config": res["config"],
                             "pad_fraction": (res.get("extra") or {}).get("pad_fraction"), "probed_after": True}
        except (json.JSONDecodeError, KeyError):
            out[batching] = {"error": proc.stderr[-1500:]}
    return out


def recipe(run: Path, data: Path, steps: int, work: Path, tag: str) -> dict[str, Any]:
    """The exported hf-trainer recipe on `data` for `steps` steps under the run's limit."""
    script = work / f"train-{tag}.py"
    subprocess.run([sys.executable, "-m", "autofit", "export", str(run), "-o", str(script), "--force"], check=True,
                   env=bench_env(), cwd=REPO)
    best = json.loads((run / "best.json").read_text())
    limit = best["target"].get("memory_limit_bytes")
    cmd = [sys.executable, str(script), "--dataset", str(data), "--output-dir", str(work / f"out-{tag}"),
           "--max-steps", str(steps), *(["--emulate-memory-gib", str(limit / GIB)] if limit else [])]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=600)
    except subprocess.TimeoutExpired as e:
        return {"rc": None, "error": f"timed out after {e.timeout} s", "steps": steps}
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("recipe-summary ")]
    summary = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    peak = None
    if "max_memory_reserved" in summary:  # the probe's definition: reserved peak + memory outside the allocator
        peak = summary["max_memory_reserved"] + max(summary["device_used"] - summary["memory_reserved_now"], 0)
    tps = summary.get("tokens_per_s")
    return {"rc": proc.returncode, "oom": "out of memory" in (proc.stdout + proc.stderr).lower(), "steps": steps,
            "wall_seconds": time.monotonic() - t0, "tokens_per_s": tps, "peak_bytes": peak, "limit_bytes": limit,
            "tokens_per_s_ratio": tps / best["tokens_per_s"] if tps else None,
            "peak_ratio": peak / best["peak_memory_bytes"] if peak else None,
            "inside_limit": bool(proc.returncode == 0 and (not limit or (peak or 0) <= limit)),
            "stderr_tail": proc.stderr[-1200:]}


def longest_only(data: Path, work: Path, keep: int = 64) -> Path:
    """The `keep` longest rows, repeated: every micro-batch is as heavy as the data makes it."""
    rows = [x for x in data.read_text().splitlines() if x.strip()]
    rows.sort(key=len, reverse=True)
    out = work / f"{data.stem}-longest.jsonl"
    out.write_text("\n".join(rows[:keep] * 4) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny-llama on the CPU with the committed slices")
    p.add_argument("--datasets", default="D1,D2")
    p.add_argument("--limits", help="comma list of memory limits (default 40GiB,24GiB: S1, S2)")
    p.add_argument("--skip-recipes", action="store_true", help="searches only (split the work over two calls)")
    p.add_argument("--no-fill", action="store_true",
                   help="do not probe the winner's config with pad_longest / pad_max when the search did not")
    p.add_argument("--steps", type=int, default=None, help="recipe steps (default 50; 3 with --small)")
    p.add_argument("--budget", help="per search (default 100s; 150s with --small)")
    p.add_argument("--name", default=None)
    p.add_argument("--runs", help="recipes only, from run folders of an earlier call: D1=DIR,D2=DIR")
    a = p.parse_args()
    s = dict(SMALL if a.small else FULL, **({"budget": a.budget} if a.budget else {}),
             **({"limits": a.limits.split(",")} if a.limits else {}))
    steps = a.steps or (3 if a.small else 50)
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    space = work / "data-space.yaml"
    space.write_text(DATA_SPACE.format(**s))
    files = corpora(a.small, work)
    figures: dict[str, Any] = {"small": a.small, "max_length": s["max_length"], "model": s["model"], "searches": {},
                               "recipes": {}}
    first: dict[str, Path] = {}
    name_of = a.name or ("data-bench-cpu-small" if a.small else "data-bench-s1-s2")
    if a.runs:  # the searches were an earlier call's: their run folders, kept by keep_runs
        first.update({k: Path(v).resolve() for k, v in (x.split("=", 1) for x in a.runs.split(","))})
        figures["recipes_of"] = {k: v.name for k, v in first.items()}
    for limit in [] if a.runs else s["limits"]:
        for name in a.datasets.split(","):
            key = f"{limit or 'no-limit'}/{name}"
            run, tail = search(s, space, files[name], limit, work / "runs")
            figures["searches"][key] = compare(run) if run else {"error": tail}
            if run and not a.no_fill:
                filled = fill(s, run, files[name], limit)
                figures["searches"][key]["same_config_other_batching"] = filled
                win = figures["searches"][key]["winner"]["tokens_per_s"]
                for b, r in filled.items():
                    if r.get("tokens_per_s") and figures["searches"][key].get(f"ratio_vs_{b}") is None:
                        figures["searches"][key][f"ratio_vs_{b}"] = win / r["tokens_per_s"]
            if run and name not in first:
                first[name] = run
            print(key, {k: figures["searches"][key].get(k) for k in ("ratio_vs_pad_longest", "ratio_vs_pad_max")},
                  flush=True)
            save(name_of, figures)  # after every search: a call cut short keeps what it measured
    for name, run in ({} if a.skip_recipes else first).items():
        figures["recipes"][name] = {"same_data": recipe(run, files[name], steps, work, f"{name}"),
                                    "longest_samples": recipe(run, longest_only(files[name], work), max(3, steps // 5),
                                                              work, f"{name}-longest")}
        print(name, {k: figures["recipes"][name]["same_data"][k] for k in ("tokens_per_s_ratio", "peak_ratio")},
              "longest inside limit:", figures["recipes"][name]["longest_samples"]["inside_limit"], flush=True)
    save(name_of, figures)
    if not a.runs:
        keep_runs(work / "runs", out_dir() / f"{name_of}-runs")
    print(f"results in {out_dir()}")


def keep_runs(runs: Path, dest: Path) -> None:
    """The searches' run folders (trials, study, report; logs left out) as one archive beside the figures."""
    import shutil

    if runs.is_dir():
        staged = runs.parent / "kept"
        shutil.copytree(runs, staged, ignore=shutil.ignore_patterns("logs", ".standby*", "*.png"), dirs_exist_ok=True)
        shutil.make_archive(str(dest), "gztar", staged)


if __name__ == "__main__":
    main()
