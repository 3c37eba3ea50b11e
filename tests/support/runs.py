"""Run folders as `autofit search` leaves them, written rather than searched: for the tests of what reads
one (export, regress, report, resume) without the minute a real search takes; and a recorded regress check
read back as `regress.decide` takes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from conftest import DATA_DIR

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.data import DatasetRef, load_samples
from autofit.data.preference import read_preferences
from autofit.run import regress
from autofit.run.best import BestEntry
from autofit.run.rundir import target_dict

MIB = 2**20
BASE = BestEntry("winner", TrialConfig(max_length=128, micro_batch_size=4, global_batch=4), 1000.0, 100 * MIB)
D1 = DATA_DIR / "d1-slice.jsonl"
"""The committed slice of D1 (docstrings), as a user's JSONL file."""
CHAT = DATA_DIR / "d1-chat-slice.jsonl"
"""The same samples as chats (a 'messages' list a row)."""
PREFS = DATA_DIR / "prefs.jsonl"
"""Preference pairs as text, each with its prompt."""
PREFS_CHAT = DATA_DIR / "prefs-chat.jsonl"
"""Preference pairs as conversations, chosen and rejected alone (TRL's implicit prompt: their shared start)."""


def write_run(run_dir: Path, limit: int | None = 2 * 2**30, **winner: Any) -> Path:
    """A run folder as `autofit search` leaves it (spec.yaml, best.json with a runner-up, env.json)."""
    run_dir.mkdir(parents=True)
    spec = {"run_id": run_dir.name, "created": "20260101T000000Z",
            "model": resolve_model("tiny-llama").to_dict(),
            "space": {"name": "s", "source": "", "fixed": {}, "dimensions": {"max_length": [128]},
                      "divisors_only": False},
            "targets": [target_dict(Target("cpu", None, "", limit))], "budget_s": 60.0,
            "storage": f"sqlite:///{run_dir.resolve() / 'study.db'}", "study_name": f"autofit-{run_dir.name}",
            "seed": 0, "probe": {"warmup_steps": 2, "timed_steps": 5, "max_probe_accumulation": 4,
                                 "timeout_s": 900.0, "confirm": 1}}
    (run_dir / "spec.yaml").write_text(yaml.safe_dump(spec))
    target = {"device": "cpu", "gpu_index": None, "gpu_name": "", "memory_limit_bytes": limit,
              "headroom": 0.05}
    entry = {"outcome": "fit", "config": BASE.config.to_dict(), "tokens_per_s": 1000.0,
             "peak_memory_bytes": 100 * MIB}
    runner_up = {**entry, "config": BASE.config.replace(micro_batch_size=2).to_dict(), "tokens_per_s": 800.0}
    best = {**entry, "run_id": run_dir.name, "target": target, "runners_up": [runner_up], **winner}
    (run_dir / "best.json").write_text(json.dumps(best))
    (run_dir / "env.json").write_text(json.dumps({"packages": {"torch": "2.0.0"}, "gpus": []}))
    return run_dir


def data_run(tmp_path: Path, batching: str, data: Path = D1, messages_field: str = "messages") -> Path:
    """A run folder as a search with --dataset leaves it (written, not measured)."""
    run = write_run(tmp_path / f"run-{batching}", None)
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of(load_samples(data, messages_field=messages_field), "text",
                                    messages_field).to_dict()
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    best = json.loads((run / "best.json").read_text())
    best["config"] = {**best["config"], "batching": batching, "max_length": 96, "micro_batch_size": 2,
                      "global_batch": 4, "precision": "fp32"}
    (run / "best.json").write_text(json.dumps(best))
    return run


def dpo_run(tmp_path: Path, data: Path = PREFS, **settings: Any) -> Path:
    """A run folder as a DPO search on a preference file leaves it (written, not measured)."""
    cfg = TrialConfig.from_dict({"trainer": "dpo", "batching": "pad_longest", "max_length": 128,
                                 "micro_batch_size": 2, "global_batch": 4, "precision": "fp32", **settings})
    run = write_run(tmp_path / f"dpo-{data.stem}", config=cfg.to_dict())
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of_preferences(read_preferences(data)).to_dict()
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run


def moved_run(tmp_path: Path, strategy: str = "padding_free") -> tuple[Path, Path]:
    """A data run whose dataset is a copy we may change (the run, the copy)."""
    copy = tmp_path / "d.jsonl"
    copy.write_bytes(D1.read_bytes())
    run = data_run(tmp_path, strategy)
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of(load_samples(copy)).to_dict()
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run, copy


def recorded(check: dict[str, Any]) -> tuple[BestEntry, regress.Measured]:
    """A recorded check's baseline, and its runs as tonight's: what `decide` takes."""
    base = BestEntry(check["name"], TrialConfig.from_dict(check["config"]), check["baseline_tokens_per_s"],
                     check["baseline_peak_bytes"])
    return base, regress.Measured(True, check["tokens_per_s"], check["peak_bytes"], "fit", "",
                                  tuple(check["runs"]), tuple(check["peaks"]), tuple(check.get("slowdowns", ())))
