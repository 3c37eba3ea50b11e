"""Issues 11 and 29: the data-aware search against a searched baseline, both measured in one session.

For each scenario (S1: 40 GiB, S2: 24 GiB; Llama-2-7B shape, LoRA, length 2048, global batch 16 samples
per optimizer step for every strategy) and each dataset (D1: the standard library's docstrings; D2:
log-normal lengths, mean ~300, p99 ~2,000; both built by bench/data/make_corpus.py):
1. the data-aware search: `autofit search --dataset` over micro-batch 1-16 x checkpointing x Liger x every
   batching strategy (micro-batch 16 is the global batch: padding_free's rows of 16 samples);
2. the baseline, a search of its own: the same space, budget and session with `batching` restricted to
   the padded strategies people use (pad_longest, group_by_length). A space that lists `batching` keeps
   its own list under --dataset (`session.data_space`), so the restriction is a space file;
3. both winners measured again --repeats times (default 3), each run a fresh probe process, alternately
   (a, b, b, a, a, b): every figure is the median of its runs with their spread, and the headline ratio
   is median over median. Each winner's step figures say what one optimizer step trains
   (accumulation, samples and trained tokens per step, whether that is the asked global batch);
4. --anomaly N: pad_max and pad_longest at micro-batch 1 with checkpointing on (S2/D1 measured 217 and
   162 trained tokens/s, pad_longest below pad_max at the same config), alternately N times each, with
   each run's time model and the host's share of its steps (all threads' CPU time over the step's wall
   time, the GPU's power): whether a short micro-batch costs more than a full row, and whether the host
   or the GPU sets its pace.
With --recipes, the first scenario's winner on each dataset is exported (hf-trainer) and trained
`--steps` steps on the same data under the same limit (no OOM, trained tokens/s within 7% of the probe,
peak <= the probe's worst case + 3%), and again on a file of only the longest samples (inside the limit).

    python bench/data_bench.py --limits 40GiB --datasets D1 --name data-bench-s1-d1   # one pair, one call (~9 min)
    python bench/data_bench.py --gpus 0,1,2,3 --name data-bench-29    # S1, S2 x D1, D2 at once, a GPU each
    python bench/data_bench.py --limits 24GiB --datasets D1 --budget 0 --anomaly 3 --name data-anomaly-s2-d1
    python bench/data_bench.py --small         # on the CPU: tiny-llama, the committed slices, length 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    GIB,
    REPO,
    bench_env,
    best_fits,
    figure_row,
    interleaved,
    keep_run,
    out_dir,
    ratio_of_medians,
    read_trials,
    save,
    step_of,
)

from autofit.config.models import resolve_model
from autofit.config.space import load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.data import DatasetRef, load_samples
from autofit.protocol.request import MAX_PROBE_ACCUMULATION
from autofit.protocol.result import ProbeResult
from autofit.run.report.lines import config_brief
from autofit.run.rundir import RunDir

SLICES = {"D1": REPO / "tests" / "data" / "d1-slice.jsonl", "D2": REPO / "tests" / "data" / "d2-slice.jsonl"}
DATA_SPACE = """\
# The data-aware benchmark space: S1/S2's shape; `batching` is added by --dataset unless listed here.
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
KERNELS = "  liger: [false, true]\n"
PADDED = ("pad_longest", "group_by_length")
"""The baseline's strategies: dynamic padding as recipes do it, with and without a length-grouping sampler."""
BASELINE = f"  batching: [{', '.join(PADDED)}]\n"
FULL = {"model": "llama2-7b", "limits": ["40GiB", "24GiB"], "max_length": 2048, "gb": 16, "r": 16, "alpha": 32,
        "prec": "bf16", "opt": "adamw_torch_fused", "mbs": "[1, 2, 4, 8, 16]", "ckpt": "[off, on]", "budget": "120s",
        "kernels": True, "repeats": 3, "device": []}
SMALL = {"model": "tiny-llama", "limits": [None], "max_length": 128, "gb": 4, "r": 8, "alpha": 16, "prec": "fp32",
         "opt": "adamw_torch", "mbs": "[1, 2]", "ckpt": "[off]", "budget": "90s", "kernels": False, "repeats": 2,
         "device": ["--device", "cpu"]}
ANOMALY = {"micro_batch_size": 1, "gradient_checkpointing": "on"}
"""The config where S2/D1 measured pad_longest (162) below pad_max (217): only the batching differs."""


def corpora(small: bool, work: Path) -> dict[str, Path]:
    if small:
        return dict(SLICES)
    subprocess.run([sys.executable, str(REPO / "bench" / "data" / "make_corpus.py"), "--out", str(work)], check=True)
    return {"D1": work / "d1.jsonl", "D2": work / "d2.jsonl"}


def seconds(budget: str) -> float:
    return float(budget.rstrip("sm")) * (60 if budget.endswith("m") else 1)


def write_spaces(s: dict[str, Any], work: Path) -> dict[str, Path]:
    """The data-aware space (every strategy, through --dataset) and the baseline's (the padded ones), the
    other dimensions the same."""
    common = DATA_SPACE.format(**s) + (KERNELS if s["kernels"] else "")
    paths = {"searched": work / "data-space.yaml", "baseline": work / "baseline-space.yaml"}
    paths["searched"].write_text(common)
    paths["baseline"].write_text(common + BASELINE)
    return paths


def search(s: dict[str, Any], space: Path, data: Path, limit: str | None, runs: Path,
           gpu: int | None) -> tuple[Path | None, str]:
    where = ["--gpu", str(gpu)] if gpu is not None else s["device"]
    cmd = [sys.executable, "-m", "autofit", "search", "--model", s["model"], "--space", str(space), "--dataset",
           str(data), "--max-length", str(s["max_length"]), "--budget", s["budget"], "--confirm", "0", "--out",
           str(runs), "--json", *where, *(["--memory-limit", limit] if limit else [])]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=bench_env(), cwd=REPO,
                              timeout=seconds(s["budget"]) + 180)
    except subprocess.TimeoutExpired:
        return None, "the search overran its budget by 180 s"
    try:
        return Path(json.loads(proc.stdout)["run_dir"]), proc.stderr[-1500:]
    except (json.JSONDecodeError, KeyError):
        return None, proc.stderr[-3000:]


def summary(run: Path) -> dict[str, Any]:
    """A search's winner (its own figure and step figures) and the best fit of each batching it probed."""
    rows = read_trials(run)
    best = best_fits(rows)
    win = json.loads((run / "best.json").read_text()) if (run / "best.json").is_file() else None
    return {"run": run.name, "probes": len(rows),
            "outcomes": {o: sum(r["outcome"] == o for r in rows) for o in sorted({r["outcome"] for r in rows})},
            "winner": None if win is None else {
                "config": win["config"], "brief": config_brief(win["config"]), "tokens_per_s": win["tokens_per_s"],
                "measurements": (win.get("extra") or {}).get("measurements"),
                "peak_gib": round(win["peak_memory_bytes"] / GIB, 2) if win.get("peak_memory_bytes") else None,
                "step": step_of(win)},
            "best_by_batching": {b: {"tokens_per_s": r["tokens_per_s"], "brief": config_brief(r["config"]),
                                     "pad_fraction": (r.get("extra") or {}).get("pad_fraction"), "step": step_of(r)}
                                 for b, r in best.items()}}


@dataclass(frozen=True)
class Where:
    """What the fresh-process runs of a pair share: its target (GPU, memory limit), model, data and the
    stand-in tokenizer's cache (a search's run folder's, where one ran: no second tokenizer training)."""

    target: Any
    model: Any
    dataset: dict[str, Any]
    data_cache: Path
    space: Any

    @classmethod
    def of(cls, s: dict[str, Any], space: Path, data: Path, limit: str | None, gpu: int | None,
           cache: Path) -> Where:
        device = s["device"][1] if s["device"] else None
        return cls(resolve_targets(None if gpu is None else str(gpu), device, limit)[0], resolve_model(s["model"]),
                   DatasetRef.of(load_samples(data)).to_dict(), cache,
                   load_space(str(space)).replaced(max_length=[s["max_length"]]))


def measure(where: Where, configs: dict[str, TrialConfig], n: int, out: dict[str, Any], on_change: Any) -> None:
    """configs measured n times each, alternately, in fresh probe processes on the pair's target and data;
    out[label] becomes {config, runs, figure: spread_figure of the fits' tokens/s}, filled as runs come."""
    for label, cfg in configs.items():
        out[label] = figure_row(cfg.to_dict())

    def keep(label: str, res: ProbeResult) -> None:
        keep_run(out[label], res)
        on_change()

    interleaved(where.target, where.model, configs, n, keep, max_acc=MAX_PROBE_ACCUMULATION, dataset=where.dataset,
                data_cache=where.data_cache, prefix="repeat")


def winners(runs: dict[str, Path]) -> dict[str, TrialConfig]:
    """Each search's winner, once: where both searches picked the same config it is measured under the
    searched label only (its ratio is then 1)."""
    out: dict[str, TrialConfig] = {}
    for label, run in runs.items():
        best = run / "best.json"
        if best.is_file():
            cfg = TrialConfig.from_dict(json.loads(best.read_text())["config"])
            if all(cfg.key() != other.key() for other in out.values()):
                out[label] = cfg
    return out


def anomaly_configs(space: Any) -> dict[str, TrialConfig]:
    """pad_max and pad_longest at ANOMALY, the rest of the data space as fixed (stock kernels)."""
    return {b: space.config({**ANOMALY, "batching": b, "liger": False}) for b in ("pad_max", "pad_longest")}


class Book:
    """The result file, rewritten whole after every stage from whichever thread measured it: a call cut
    short keeps what it measured."""

    def __init__(self, name: str, figures: dict[str, Any]) -> None:
        self.name, self.figures, self.lock = name, figures, threading.Lock()

    def save(self) -> None:
        with self.lock:
            save(self.name, json.loads(json.dumps(self.figures, default=str)))


def pair(s: dict[str, Any], a: argparse.Namespace, spaces: dict[str, Path], files: dict[str, Path],
         limit: str | None, name: str, gpu: int | None, work: Path, book: Book) -> Path | None:
    """One scenario x dataset: the two searches, their winners' repeats, the anomaly pair; returns the
    data-aware search's run folder."""
    key = f"{limit or 'no-limit'}/{name}"
    entry: dict[str, Any] = {"gpu": gpu, "budget": s["budget"], "baseline_batchings": list(PADDED)}
    book.figures["pairs"][key] = entry
    runs: dict[str, Path] = {}
    for label in ("searched", "baseline") if seconds(s["budget"]) > 0 else ():
        t0 = time.monotonic()
        run, tail = search(s, spaces[label], files[name], limit, work / "runs" / key.replace("/", "-") / label, gpu)
        entry[label] = {**summary(run), "wall_seconds": round(time.monotonic() - t0, 1)} if run else {"error": tail}
        if run:
            runs[label] = run
        print(key, label, (entry[label].get("winner") or {}).get("brief"),
              (entry[label].get("winner") or {}).get("tokens_per_s"), flush=True)
        book.save()
    if runs:  # the run folders kept now: a call cut short in its repeats still leaves them (data_parity reads them)
        with book.lock:
            keep_runs(work / "runs", out_dir() / f"{book.name}-runs")
    if runs.get("searched"):
        data = json.loads((runs["searched"] / "data" / "data.json").read_text())
        entry.update(mean_sample=data["mean"], percentiles=data["percentiles"], approximate=data["approximate"])
    cache = RunDir(runs["searched"]).data if "searched" in runs else work / "data-cache" / key.replace("/", "-")
    where = Where.of(s, spaces["searched"], files[name], limit, gpu, cache)
    if runs and s["repeats"]:
        entry["repeats"] = {}

        def ratio_then_save() -> None:  # after every run: a call cut short keeps the ratio of what it measured
            figs = {k: v["figure"] for k, v in entry["repeats"].items()}
            entry["ratio_of_medians"] = ratio_of_medians(figs["searched"], figs["baseline"]) \
                if "searched" in figs and "baseline" in figs else (1.0 if len(figs) == 1 and len(runs) == 2 else None)
            book.save()

        measure(where, winners(runs), s["repeats"], entry["repeats"], ratio_then_save)
    if a.anomaly:
        entry["anomaly"] = {"config": ANOMALY, "measured": {}}
        measure(where, anomaly_configs(where.space), a.anomaly, entry["anomaly"]["measured"], book.save)
        m = entry["anomaly"]["measured"]
        entry["anomaly"]["pad_longest_over_pad_max"] = ratio_of_medians(m["pad_longest"]["figure"],
                                                                        m["pad_max"]["figure"])
        book.save()
    return runs.get("searched")


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
    summary_line = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    peak = None
    if "max_memory_reserved" in summary_line:  # the probe's definition: reserved peak + memory outside the allocator
        peak = summary_line["max_memory_reserved"] + max(summary_line["device_used"]
                                                         - summary_line["memory_reserved_now"], 0)
    tps = summary_line.get("tokens_per_s")
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
    p.add_argument("--budget", help="per search, the same for both (default 120s; 90s with --small; 0: no searches, "
                                    "only --anomaly)")
    p.add_argument("--repeats", type=int, help="fresh-process runs of each winner (default 3; 2 with --small; 0: none)")
    p.add_argument("--no-kernels", action="store_true", help="leave Liger out of both spaces")
    p.add_argument("--anomaly", type=int, default=0, metavar="N",
                   help="also measure pad_max and pad_longest at micro-batch 1 with checkpointing, N runs each")
    p.add_argument("--gpus", default="", help="comma list: the scenario x dataset pairs run at once, one GPU each")
    p.add_argument("--recipes", action="store_true", help="export and train the first scenario's winners")
    p.add_argument("--steps", type=int, default=None, help="recipe steps (default 50; 3 with --small)")
    p.add_argument("--name", default=None)
    p.add_argument("--runs", help="recipes only, from run folders of an earlier call: D1=DIR,D2=DIR")
    a = p.parse_args()
    s = dict(SMALL if a.small else FULL, **({"budget": a.budget} if a.budget else {}),
             **({"limits": a.limits.split(",")} if a.limits else {}),
             **({"repeats": a.repeats} if a.repeats is not None else {}))
    if a.no_kernels:
        s["kernels"] = False
    steps = a.steps or (3 if a.small else 50)
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    spaces = write_spaces(s, work)
    files = corpora(a.small, work)
    name_of = a.name or ("data-bench-cpu-small" if a.small else "data-bench-s1-s2")
    book = Book(name_of, {"small": a.small, "max_length": s["max_length"], "model": s["model"],
                          "space": spaces["searched"].read_text(), "baseline_space": spaces["baseline"].read_text(),
                          "repeats": s["repeats"], "pairs": {}, "recipes": {},
                          "note": "every tokens/s figure is trained (label-bearing, non-pad) tokens/s; a repeats "
                                  "figure is the median of fresh-process runs measured alternately in this call, "
                                  "spread = max/min; ratio_of_medians = searched winner / baseline winner"})
    first: dict[str, Path] = {}
    if a.runs:  # the searches were an earlier call's: their run folders, kept by keep_runs
        first.update({k: Path(v).resolve() for k, v in (x.split("=", 1) for x in a.runs.split(","))})
        book.figures["recipes_of"] = {k: v.name for k, v in first.items()}
    jobs = [] if a.runs else [(limit, name) for limit in s["limits"] for name in a.datasets.split(",")]
    gpus = [int(g) for g in a.gpus.split(",") if g.strip()]
    with ThreadPoolExecutor(max(1, min(len(gpus), len(jobs)))) as pool:
        done = list(pool.map(lambda i: pair(s, a, spaces, files, jobs[i][0], jobs[i][1],
                                            gpus[i % len(gpus)] if gpus else None, work, book), range(len(jobs))))
    for (_limit, name), run in zip(jobs, done, strict=True):
        if run and name not in first:
            first[name] = run
    for name, run in (first.items() if a.recipes or a.runs else ()):
        book.figures["recipes"][name] = {
            "same_data": recipe(run, files[name], steps, work, f"{name}"),
            "longest_samples": recipe(run, longest_only(files[name], work), max(3, steps // 5), work,
                                      f"{name}-longest")}
        book.save()
    book.save()
    if not a.runs:
        keep_runs(work / "runs", out_dir() / f"{name_of}-runs")
    print(json.dumps({k: {x: v.get(x) for x in ("ratio_of_medians",)} for k, v in book.figures["pairs"].items()}))
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
