"""Issue 4's fidelity check: the exported recipe vs the probe that measured it.

Exports RUN's winner (hf-trainer; a DPO run's as TRL's DPOTrainer script, `trl`), runs the script for --steps
optimizer steps under the same memory limit (the script's --emulate-memory-gib), and compares its speed
(tokens/s; a DPO run's pairs/s) and peak memory with the probe's. Targets: no OOM, speed within 5%, peak within 3%.
The recipe runs through `bench/recipe_steps.py` (its own main(), its callback also printing each step), so the
speed is compared twice: the recipe's own figure (every step after two warm-ups) and its run's second half.
A DPO run with precomputed log-probabilities is compared with TRL's pass counted on both sides (its seconds per
pair added to the steps' time, as the probe's figure counts it), and the steps' own rates beside it.

A recipe loads a model folder with its tokenizer (`--model`). A run measured on a shape preset (random
weights, no tokenizer) gets one made here (`model_folder`): the preset's random weights, and the tokenizer
the probe used: on a dataset, the run's stand-in BPE (`RUN/data/standin-bpe-*.json`); without one, a byte-level
BPE trained on the bench's text (every sequence is a full block of max_length, whatever the tokenizer).

    python bench/export_bench.py --run RUN_FOLDER --steps 50 [--dataset DATA]   # DATA: a run searched on it
    python bench/export_bench.py --run DPO_RUN --dataset PAIRS --steps 20 --name dpo-export-s7
    python bench/data/make_corpus.py --out /tmp/d    # D2, then S1/D2's packed and padding-free winners probed now:
    python bench/export_bench.py --search bench/spaces/s1-d2-packed.yaml --dataset /tmp/d/d2.jsonl --steps 30 \
        --name export-fidelity-s1-d2-packed          # (and s1-d2-padding-free.yaml)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from common import GIB, autofit_cli, save


def model_folder(run: Path, work: Path, texts: Path) -> Path | None:
    """A folder the recipe's --model reads for a preset run (None: the run's model is a real one)."""
    model = yaml.safe_load((run / "spec.yaml").read_text())["model"]
    if model.get("kind") not in ("preset", "config"):
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = work / "model"
    standin = sorted((run / "data").glob("standin-bpe-*.json")) if (run / "data").is_dir() else []
    if standin:  # the probe's own stand-in, trained on the run's dataset
        bpe = Tokenizer.from_str(standin[0].read_text(encoding="utf-8"))
    else:
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        lines = [json.loads(x)["text"] for x in texts.read_text().splitlines() if x.strip()]
        bpe.train_from_iterator(lines, trainers.BpeTrainer(
            vocab_size=int(model["config"].get("vocab_size", 32000)), special_tokens=["<pad>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder)
    save_random_model(model["config"], folder)
    return folder


RANDOM_MODEL = """
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model(**json.loads(sys.argv[1]))
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype="bfloat16")
model.save_pretrained(sys.argv[2])
"""


def save_random_model(config: dict[str, object], folder: Path) -> None:
    """The preset's random weights, as probed, saved in `folder` by a child process: drawn on the GPU where there is
    one (a 7B on the CPU takes minutes), and the child's CUDA context gone before the recipe runs. The recipe's peak
    counts the whole device's used memory: a context left in this process (about 0.5 GiB) was counted as the
    recipe's until 2026-12-05."""
    subprocess.run([sys.executable, "-c", RANDOM_MODEL, json.dumps(config), str(folder)], check=True)


def searched(a: argparse.Namespace) -> Path:
    """`autofit search` of the space on the dataset, as a user runs it: its run folder."""
    runs = Path(tempfile.mkdtemp(prefix="export-bench-")) / "runs"
    cmd = ["search", "--model", a.model, "--space", a.search, "--memory-limit", a.limit, "--budget", "10m",
           "--out", str(runs), *(["--dataset", a.dataset] if a.dataset else []),
           *(["--device", a.device] if a.device else [])]
    proc = autofit_cli(*cmd, timeout=1800)
    folders = sorted(runs.iterdir()) if runs.is_dir() else []
    if not folders or not (folders[-1] / "best.json").is_file():
        sys.exit(f"export_bench: the search found no fit (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return folders[-1]


def printed(stdout: str, tag: str) -> list[dict[str, Any]]:
    """The JSON of each `tag {...}` line bench/recipe_steps.py printed, in order."""
    return [json.loads(x.split(" ", 1)[1]) for x in stdout.splitlines() if x.startswith(tag + " ")]


def dpo_pairs(best: dict[str, Any], summary: dict[str, Any], passes: list[dict[str, Any]],
              hashes: list[dict[str, Any]]) -> dict[str, Any]:
    """A DPO run's pairs/s, probe and recipe alike: the steps' own rate and, with precomputed log-probabilities,
    the rate with the pass's seconds per pair added (the probe's figure counts it over one epoch, the weights'
    hash once over the dataset's pairs; the recipe's Throughput times its steps only, and bench/recipe_steps.py
    times TRL's pass and hash). Empty without a figure."""
    probe, recipe = best.get("pairs_per_s"), summary.get("pairs_per_s")
    if not (probe and recipe):
        return {}
    extra = best.get("extra") or {}
    probe_pass = extra.get("precompute_s_per_pair")
    if probe_pass is None:  # a probe before the pass was timed batch by batch: its whole pass over its pairs
        probe_pass = (extra.get("precompute_seconds") or 0.0) / max(extra.get("precompute_pairs") or 0, 1)
    train = [p for p in passes if p.get("name") == "train"] or passes
    hashed = sum(h["seconds"] for h in hashes)
    recipe_pass = (train[-1]["seconds"] + hashed) / max(train[-1]["pairs"], 1) if train else 0.0
    with_pass = 1 / (1 / recipe + recipe_pass)
    # the probe's steps alone: its figure less the pass (kept where an older probe's pass figure exceeds it)
    probe_step = 1 / (1 / probe - probe_pass) if 0 <= probe_pass < 1 / probe else probe
    return {"probe_pass_s_per_pair": probe_pass, "recipe_pass_s_per_pair": recipe_pass,
            "recipe_pass": train[-1] if train else None,
            "probe_step_pairs_per_s": probe_step, "recipe_step_pairs_per_s": recipe,
            "recipe_pairs_per_s_with_pass": with_pass, "step_pairs_per_s_ratio": recipe / probe_step,
            "pairs_per_s_ratio": with_pass / probe}


def at_data_mean(fig: dict[str, Any]) -> dict[str, Any]:
    """A DPO recipe's pairs/s at the data's mean pair, where the probe's figure is (its time model brings each
    step there): the recipe's tokens/s over the data's tokens a pair (the probe's tokens/s over its pairs/s), the
    precomputed pass's seconds a pair added as on the raw figure. The raw pairs/s counts the pairs the recipe's
    steps happened to draw: S7's 32 steady steps held 907 tokens a pair against the data's 919, so 1.3% more
    pairs a second at the same speed. Empty without the figures."""
    probe_pairs, probe_tokens, recipe_tokens = (fig.get(k) for k in ("probe_pairs_per_s", "probe_tokens_per_s",
                                                                      "recipe_tokens_per_s"))
    if not (probe_pairs and probe_tokens and recipe_tokens):
        return {}
    per_pair = probe_tokens / probe_pairs
    at_mean = 1 / (per_pair / recipe_tokens + (fig.get("recipe_pass_s_per_pair") or 0.0))
    return {"tokens_per_pair": per_pair, "recipe_pairs_per_s_at_data_mean": at_mean,
            "pairs_per_s_ratio_at_data_mean": at_mean / probe_pairs}


def meets_targets(fig: dict[str, Any]) -> bool:
    """Speed within 5% (a DPO run's pairs/s at the data's mean pair) and peak within 3% of the probe's."""
    speed = fig.get("pairs_per_s_ratio_at_data_mean") or fig.get(f"{fig['speed']}_ratio")
    peak = fig.get("peak_ratio")
    return bool(fig["rc"] == 0 and not fig["oom"] and speed and abs(speed - 1) <= 0.05 and peak
                and abs(peak - 1) <= 0.03)


def refigure(name: str) -> None:
    """Recompute the derived figures of bench/results/NAME.json from its recorded ones (no run)."""
    path = Path(__file__).resolve().parent / "results" / f"{name}.json"
    fig = json.loads(path.read_text())
    if fig.get("speed") == "pairs_per_s":
        fig.update(at_data_mean(fig))
    fig["meets_targets"] = meets_targets(fig)
    fig.setdefault("refigured", []).append(" ".join(["python3", "bench/export_bench.py", *sys.argv[1:]]))
    save(name, fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--refigure", metavar="NAME", help="recompute bench/results/NAME.json's derived figures "
                                                          "from its recorded ones (no run)")
    where.add_argument("--run", help="a run folder: its winner is exported")
    where.add_argument("--search", metavar="SPACE", help="search SPACE first (a one-point space: that config probed "
                                                         "now, by this checkout) and export its winner")
    p.add_argument("--model", default="llama2-7b", help="with --search")
    p.add_argument("--limit", default="40GiB", help="with --search: the memory limit")
    p.add_argument("--device", help="with --search: cpu for a dry run")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--name", default="export-fidelity-s1")
    p.add_argument("--dataset", help="the dataset RUN was searched on (default: the bench's random words; a DPO "
                                     "run's preference file is needed)")
    p.add_argument("--stop-after", type=float, help="seconds from the recipe's start after which it ends at its next "
                                                    "step (fewer than --steps: the figures say how many ran), and "
                                                    "is killed 4 minutes later; default: no limit")
    a = p.parse_args()
    if a.refigure:
        refigure(a.refigure)
        return
    run = Path(a.run) if a.run else searched(a)
    best = json.loads((run / "best.json").read_text())
    dpo = best["config"].get("trainer") == "dpo"
    if dpo and not a.dataset:
        sys.exit("export_bench: a DPO run trains on its preference pairs: give the file with --dataset")
    speed = "pairs_per_s" if dpo else "tokens_per_s"  # what the search maximised, probe and recipe alike
    shm = Path("/dev/shm")  # the stand-in model's 13 GiB written and read back from memory, where there is room
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 40 * GIB
    work = Path(tempfile.mkdtemp(dir=shm if roomy else None))
    script = work / "train.py"
    subprocess.run([sys.executable, "-m", "autofit", "export", str(run), "--format", "trl" if dpo else "hf-trainer",
                    "-o", str(script)], check=True)
    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
             for _ in range(2000)]
    with open(work / "data.jsonl", "w") as f:  # ~400k bytes: the byte tokenizer makes ~200 blocks of 2048
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(180))}) + "\n")
    limit = best["target"].get("memory_limit_bytes")
    data = Path(a.dataset) if a.dataset else work / "data.jsonl"
    runner = Path(__file__).with_name("recipe_steps.py")  # the recipe's main(), each step printed too
    cmd = [sys.executable, str(runner), str(script), "--dataset", str(data), "--output-dir", str(work / "out"),
           "--max-steps", str(a.steps)]
    model = model_folder(run, work, data)
    if model is not None:
        cmd += ["--model", str(model)]
    if limit:
        cmd += ["--emulate-memory-gib", str(limit / GIB)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"RECIPE_STOP_AFTER": str(a.stop_after)} if a.stop_after else {}))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=a.stop_after + 240 if a.stop_after else None)
    except subprocess.TimeoutExpired as e:  # what it printed before, and an exit status that says so
        text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        proc = subprocess.CompletedProcess(cmd, 124, text[0], text[1] + "\nexport_bench: the recipe was killed")
    wall = time.monotonic() - t0
    summary = (printed(proc.stdout + "\n" + proc.stderr, "recipe-summary") or [{}])[-1]
    steps = printed(proc.stdout, "recipe-steps")
    late = None
    if steps and steps[-1]["seconds"]:  # the run's second half: past its first steps' allocations, as a long run
        half = len(steps[-1]["seconds"]) // 2
        late = sum(steps[-1]["tokens"][half:]) / sum(steps[-1]["seconds"][half:])
    allocator = printed(proc.stdout, "recipe-allocator")
    oom = "out of memory" in (proc.stderr + proc.stdout).lower()
    recipe_peak = None
    if "max_memory_reserved" in summary:
        # the same definition as the probe: reserved peak + memory outside the allocator
        outside = summary["device_used"] - summary["memory_reserved_now"]
        recipe_peak = summary["max_memory_reserved"] + max(outside, 0)
    tps_ratio = summary.get(speed, 0) / best[speed] if summary and best.get(speed) else None
    pairs = dpo_pairs(best, summary, printed(proc.stdout, "recipe-precompute"),
                      printed(proc.stdout, "recipe-precompute-hash")) if dpo else {}
    if pairs.get("pairs_per_s_ratio") is not None:  # like for like: the precomputed pass counted on both sides
        tps_ratio = pairs["pairs_per_s_ratio"]
    peak_ratio = recipe_peak / best["peak_memory_bytes"] if recipe_peak else None
    figures = {
        "run_id": best["run_id"], "config": best["config"], "steps": a.steps, "rc": proc.returncode, "oom": oom,
        "recipe_stopped": (printed(proc.stdout, "recipe-stopped") or [None])[-1],
        "recipe_wall_seconds": wall, "recipe_summary": summary, "speed": speed,
        "probe_tokens_per_s": best["tokens_per_s"], "recipe_tokens_per_s": summary.get("tokens_per_s"),
        "probe_tokens_per_s_range": [best.get("tokens_per_s_min"), best.get("tokens_per_s_max")],
        "probe_step": best.get("step"), "recipe_steps": steps[-1] if steps else None,
        "recipe_late_tokens_per_s": late if not dpo else None,
        "late_tokens_per_s_ratio": late / best["tokens_per_s"] if late and not dpo and best.get("tokens_per_s")
        else None,
        **({"probe_pairs_per_s": best.get("pairs_per_s"), "recipe_pairs_per_s": summary.get("pairs_per_s"), **pairs}
           if dpo else {}),
        "tokens_per_s_ratio" if not dpo else "pairs_per_s_ratio": tps_ratio, "target_speed_within": 0.05,
        "probe_peak_bytes": best["peak_memory_bytes"], "recipe_peak_bytes": recipe_peak,
        "probe_allocator": {k: best.get(k) for k in ("max_memory_allocated", "max_memory_reserved",
                                                      "memory_outside_allocator")},
        "recipe_allocator": allocator[-1] if allocator else None,
        "peak_ratio": peak_ratio, "target_peak_within": 0.03,
        "stderr_tail": proc.stderr[-1500:],
    }
    figures.update(at_data_mean(figures) if dpo else {})
    figures["meets_targets"] = meets_targets(figures)
    save(a.name, figures)
    print({k: v for k, v in figures.items() if k.endswith(("_per_s", "_ratio", "_bytes")) or k in ("rc", "oom",
                                                                                                "meets_targets")})


if __name__ == "__main__":
    main()
