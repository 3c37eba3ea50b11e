"""Issue 29: loss parity at equal samples per step on D2, from a trained base.

From a D2 run folder of `data_bench.py` (its model, dataset and configs), three exported hf-trainer recipes
trained --steps optimizer steps each from the same trained base, on the same file:
- pad_longest (the reference: dynamic padding, global batch 16 samples per step);
- padding_free and packed, each at its best measured config in the run (else the run winner's);
all at the samples per step the probe's rule gives (`data.batching.step_shape`: pad_longest and padding_free
16 samples; packed rows at the accumulation nearest 16 samples from the plan's mean samples per row). Their
logged losses (means over the logging interval) are compared: the largest relative difference of each
against pad_longest's; the issue's target is within 1% over 30 steps.
The base is kernels_bench's: the preset's random weights saved (with the data's stand-in tokenizer, the one
the search measured lengths with), trained --warm-steps steps by the pad_longest recipe on the same data,
its adapter merged: fine-tuning starts from a settled loss, where a strategy that trains something
different shows as a lasting offset, not as one step's lead in a steep fall.
Speed is not measured here: every recipe runs with checkpointing on (it does not change the loss) and,
with --together, the three run at once on one GPU.

The exported recipes follow the probe's rule themselves (padding_free: micro_batch_size samples flattened a
row; packed: the plan's accumulation, from best.json): nothing is patched.

    python bench/data_parity.py --run RUN_D2 --dataset d2.jsonl --together --name data-parity-d2   # GPU
    python bench/data_parity.py --small                # tiny-llama on the CPU: a short D2-slice search first
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import REPO, SMALL_FIXED, autofit_cli, best_fits, read_trials, save
from data_bench import SLICES
from kernels_bench import STOCK, curve_diff, run_recipe, variant_copy, warm_base

from autofit.config.spec import KEYS
from autofit.data.shapes import shapes_of
from autofit.run.rundir import RunDir, load_spec

STRATEGIES = ("pad_longest", "padding_free", "packed")
PARITY = {**STOCK, "gradient_checkpointing": "on"}
"""Every parity recipe: stock kernels, checkpointing on (the loss is the same, the memory smaller)."""
TOLERANCE = 0.01
SMALL_SPACE = SMALL_FIXED + """\n  micro_batch_size: [2]\n  batching: [pad_longest, padding_free, packed]\n"""


def run_folder(path: Path) -> Path:
    """`path` if it is a run folder; in a data_bench archive's folder (`<limit>-D2/searched/<run>/`), the data-aware
    search's run."""
    if (path / "best.json").is_file() or (path / "spec.yaml").is_file():
        return path
    found = sorted({*path.glob("searched/*/spec.yaml"), *path.glob("*/searched/*/spec.yaml")})
    if len(found) != 1:
        raise SystemExit(f"data_parity: --run {path} is neither a run folder nor a data_bench folder with one "
                         f"searched run ({len(found)} found); give the run folder itself")
    return found[0].parent


def configs(run: Path) -> dict[str, dict[str, Any]]:
    """Each strategy's config: its best fit in the run, else the run winner's with the batching changed."""
    if not (run / "best.json").is_file():
        raise SystemExit(f"data_parity: {run} has no best.json (no fit in its search); give a run with a winner")
    win = json.loads((run / "best.json").read_text())["config"]
    best = best_fits(read_trials(run))

    def settings(cfg: dict[str, Any]) -> dict[str, Any]:  # the keys a config is made of (no derived figures)
        return {k: v for k, v in cfg.items() if k in KEYS}

    return {b: {**settings(best[b]["config"] if b in best and b != "pad_longest" else win), "batching": b, **PARITY}
            for b in STRATEGIES}


def steps_of(run: Path, data: Path, chosen: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What one optimizer step of each config trains on this data (the probe's rule, from the length table)."""
    spec = load_spec(run)
    ref = {**spec.dataset.to_dict(), "path": str(data)}  # where the file is now (its hash must match)
    shapes = shapes_of(ref, spec.model, RunDir(run).data)
    if shapes is None:
        raise SystemExit(f"data_parity: {data} is not the dataset {run.name} measured (content hash)")
    return {b: shapes.step(b, c["max_length"], c["micro_batch_size"], c["global_batch"]).to_dict()
            for b, c in chosen.items()}


def with_step(copy: Path, step: dict[str, Any]) -> Path:
    """The copy's winner with the step this config trains on the data (best.json's extra, as a search of it
    records it), so that its export takes the plan's accumulation (a packed variant of another winner)."""
    best = json.loads((copy / "best.json").read_text())
    best["extra"] = {**best.get("extra", {}), "gradient_accumulation_steps": step["gradient_accumulation_steps"],
                     "samples_per_step": step["samples_per_step"]}
    (copy / "best.json").write_text(json.dumps(best))
    return copy


def small_run(work: Path) -> tuple[Path, Path]:
    """--small: a short search on the committed D2 slice (tiny-llama, the CPU) whose folder stands in for a
    GPU call's D2 run."""
    space = work / "small-space.yaml"
    space.write_text(SMALL_SPACE)
    data = SLICES["D2"]
    proc = autofit_cli("search", "--model", "tiny-llama", "--device", "cpu", "--space", str(space), "--dataset",
                       str(data), "--max-length", "128", "--budget", "150s", "--confirm", "0", "--out",
                       str(work / "runs"), "--json", timeout=600)
    try:
        return Path(json.loads(proc.stdout)["run_dir"]), data
    except (json.JSONDecodeError, KeyError):
        raise SystemExit(f"data_parity: the small search failed: {proc.stderr[-2000:]}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a D2 run folder of data_bench.py (from its *-runs archive)")
    p.add_argument("--dataset", help="the D2 file (bench/data/make_corpus.py makes it; default: made now)")
    p.add_argument("--warm-steps", type=int, help="steps of the base's training (default 30; 3 with --small)")
    p.add_argument("--steps", type=int,
                   help="steps of each compared recipe (default 30; 10 with --small: one logged loss)")
    p.add_argument("--together", action="store_true", help="the three recipes at once on one GPU")
    p.add_argument("--small", action="store_true", help="tiny-llama on the CPU: a short D2-slice search first")
    p.add_argument("--name", help="result file (default data-parity-d2, data-parity-cpu-small)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="data-parity-"))
    if a.small:
        run, data = small_run(work)
    elif not a.run:
        p.error("--run RUN_D2 is required (a D2 run folder of data_bench.py); or --small")
    else:
        run = run_folder(Path(a.run).resolve())
        data = Path(a.dataset).resolve() if a.dataset else make_d2(work)
    warm_steps = a.warm_steps or (3 if a.small else 30)
    steps = a.steps or (10 if a.small else 30)
    name = a.name or ("data-parity-cpu-small" if a.small else "data-parity-d2")
    chosen = configs(run)
    shape = steps_of(run, data, chosen)
    figures: dict[str, Any] = {
        "run": run.name, "steps": steps, "tolerance": TOLERANCE, "configs": chosen, "step": shape,
        "note": "losses: (step, mean loss over the logging interval) of each recipe from the same trained base; "
                "max_rel_diff_vs_pad_longest: the largest relative difference at the same logged steps"}
    base, figures["warm_start"] = warm_base(run, work, warm_steps, None, chosen["pad_longest"], data)
    save(name, figures)
    if base is None:
        raise SystemExit(f"data_parity: the trained base failed: {figures['warm_start'].get('error')}")

    recipes: dict[str, dict[str, Any]] = {}
    figures["recipes"] = {}
    lock = threading.Lock()

    def one(batching: str, attempt: str = "") -> None:  # each recipe's figures saved as it ends
        folder = work / f"{batching}{attempt}"
        folder.mkdir()
        copy = with_step(variant_copy(run, work / f"copy{attempt}", batching, chosen[batching]), shape[batching])
        result = run_recipe(copy, folder, steps, None, None, base, data)
        with lock:
            recipes[batching] = result
            figures["recipes"][batching] = {k: result.get(k) for k in ("rc", "losses", "tokens_per_s",
                                                                       "wall_seconds", "error", "stderr_tail")}
            figures["recipes"][batching]["together"] = bool(a.together and not attempt)
            save(name, figures)

    with ThreadPoolExecutor(len(STRATEGIES) if a.together else 1) as pool:
        list(pool.map(one, STRATEGIES))
    # three 7B recipes at once may not fit one card (an 80 GiB H100): those that ran out of memory run again alone
    for b in [b for b, r in recipes.items() if a.together and "out of memory" in str(r.get("stderr_tail")).lower()]:
        one(b, "-alone")
    ref = recipes["pad_longest"]
    figures["max_rel_diff_vs_pad_longest"] = {b: curve_diff(recipes[b], ref) for b in STRATEGIES[1:]}
    figures["within_tolerance"] = {b: d is not None and d <= TOLERANCE
                                   for b, d in figures["max_rel_diff_vs_pad_longest"].items()}
    save(name, figures)
    print(json.dumps({k: figures[k] for k in ("max_rel_diff_vs_pad_longest", "within_tolerance")}))


def make_d2(work: Path) -> Path:
    subprocess.run([sys.executable, str(REPO / "bench" / "data" / "make_corpus.py"), "--out", str(work)], check=True)
    return work / "d2.jsonl"


if __name__ == "__main__":
    main()
