"""Scenario S3 (40 GiB): the length trade-off, through `autofit search`.

Lengths 4096, 2048 and 1024 allowed: the winner must be at the longest length at which
something fits; the report's best config at every length is compared with SCENARIOS.md's
reference points (4096: batch 1 without checkpointing, 12,801 tokens/s; 1024: batch 4
without checkpointing, 13,593; one process, no Trainer, transformers 5.17).

    python bench/lengths_bench.py --budget 180s
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from common import GIB, read_trials, save
from search_bench import run_search, search_args

from autofit.protocol.result import ProbeResult
from autofit.search.objective import best_of, best_per_length

REFERENCE = {4096: 12801, 2048: 13382, 1024: 13593}


def main() -> None:
    p = search_args("bench/spaces/s3-lengths.yaml", "180s", "search-s3-lengths")
    p.add_argument("--limit", default="40GiB")
    a = p.parse_args()
    run_dir, wall, summary = run_search(a.model, a.space, a.limit, a.budget,
                                        ["--max-probe-accumulation", a.max_probe_accumulation])
    if a.keep:
        shutil.copytree(run_dir, Path(a.keep) / "run-s3", dirs_exist_ok=True)
    rows = [ProbeResult.from_dict(d) for d in read_trials(run_dir)]
    best = best_of(rows)
    per_length = {
        L: {"tokens_per_s": r.tokens_per_s, "peak_gib": round((r.peak_memory_bytes or 0) / GIB, 2),
            "micro_batch_size": r.config["micro_batch_size"],
            "gradient_checkpointing": r.config["gradient_checkpointing"],
            "reference_tokens_per_s": REFERENCE.get(L)}
        for L, r in best_per_length(rows).items()
    }
    figures = {
        "model": a.model, "space": a.space, "limit": a.limit, "budget": a.budget,
        "run_id": run_dir.name, "stop_reason": summary.get("stop_reason"), "search_wall_seconds": wall,
        "probes_run": len(rows), "skipped": summary.get("skipped"),
        "probes_per_length": {L: sum(1 for r in rows if r.config["max_length"] == L) for L in REFERENCE},
        "winner": best and {"max_length": best.config["max_length"], "tokens_per_s": best.tokens_per_s,
                            "peak_gib": round((best.peak_memory_bytes or 0) / GIB, 2), "config": best.config},
        "winner_is_at_the_longest_length_that_fits": bool(best) and best.config["max_length"] == max(per_length),
        "best_per_length": per_length,
    }
    print(json.dumps(figures, indent=1, default=str))
    save(a.name, figures)


if __name__ == "__main__":
    main()
