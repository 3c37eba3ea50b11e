"""A run folder: `runs/<UTC time>-<model>/` and its `spec.yaml` (the exact inputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import UsageError
from .models import ModelSource
from .target import Target
from .space import Space, validate

SPEC = "spec.yaml"


def write_spec(run_dir: Path, spec: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    header = ("# The exact inputs of this search. `autofit search --resume <this folder>` continues it;\n"
              "# `autofit report <this folder>` rebuilds trials.jsonl, best.json and report.md.\n")
    (run_dir / SPEC).write_text(header + yaml.safe_dump(spec, sort_keys=False))


def read_spec(run_dir: Path, flag: str = "RUN") -> dict[str, Any]:
    path = Path(run_dir) / SPEC
    if not Path(run_dir).is_dir():
        raise UsageError(f"{flag}: no such folder {run_dir}; give a folder under runs/ made by `autofit search`.")
    if not path.is_file():
        raise UsageError(f"{flag}: {run_dir} is not an autofit run (it has no {SPEC}); give a folder made "
                         "by `autofit search`.")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{flag}: {path} is not valid YAML ({e}).") from None
    if not isinstance(spec, dict) or "model" not in spec or "space" not in spec:
        raise UsageError(f"{flag}: {path} lacks 'model' or 'space'; it is not an autofit run spec.")
    spec["storage"] = local_storage(Path(run_dir), str(spec.get("storage", "")))
    return spec


def local_storage(run_dir: Path, storage: str) -> str:
    """A study file inside a run folder that was moved or copied: follow the folder."""
    for name, url in (("study.db", f"sqlite:///{(run_dir / 'study.db').resolve()}"),
                      ("study.journal", str((run_dir / "study.journal").resolve()))):
        stored = storage[len("sqlite:///"):] if storage.startswith("sqlite:///") else storage
        if stored.endswith(name) and not Path(stored).exists() and (run_dir / name).exists():
            return url
    return storage


def space_of(spec: dict[str, Any]) -> Space:
    s = spec["space"]
    space = Space(s["name"], dict(s["fixed"]), {k: list(v) for k, v in s["dimensions"].items()},
                  s.get("source", ""), bool(s.get("divisors_only", False)))
    validate(space)
    return space


def model_of(spec: dict[str, Any]) -> ModelSource:
    return ModelSource.from_dict(spec["model"])


def targets_of(spec: dict[str, Any]) -> list[Target]:
    return [Target(**t) for t in spec["targets"]]


def target_dict(t: Target) -> dict[str, Any]:
    return {"device": t.device, "gpu_index": t.gpu_index, "gpu_name": t.gpu_name,
            "memory_limit_bytes": t.memory_limit_bytes, "headroom": t.headroom}

