"""What every exporter needs: the run's winner, its provenance, and field checks."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..spec import TrialConfig


@dataclass(frozen=True)
class ExportRun:
    """A run folder's winner and where it came from."""

    run_dir: Path
    run_id: str
    config: TrialConfig
    model: dict[str, Any]
    best: dict[str, Any]
    env: dict[str, Any]

    @property
    def weights_ref(self) -> str:
        """The model to name in a config: the source, or a placeholder for a random-weight preset."""
        return self.model["ref"] if self.model["kind"] not in ("preset", "config") else "PATH/TO/MODEL"

    def provenance(self) -> list[str]:
        """Comment lines: run id, GPU, limit, versions, measured tokens/s and peak."""
        t = self.best.get("target", {})
        gpu = t.get("gpu_name") or "CPU (no GPU)"
        limit = t.get("memory_limit_bytes")
        lim = f"{limit / 2**30:g} GiB memory limit" if limit else "no memory limit"
        v = self.env.get("packages", {})
        vers = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "peft", "bitsandbytes", "trl")
                         if k in v)
        return [
            f"Exported by autofit from run {self.run_id}.",
            f"Measured on: {gpu}, {lim}" + (" (an emulated card: that card's memory, this GPU's speed)"
                                              if limit and t.get("device") == "cuda" else ""),
            f"Driver {self.env.get('driver') or '-'}, CUDA {self.env.get('cuda_driver') or '-'}; {vers}.",
            f"Probe: {self.best['tokens_per_s']:,.0f} tokens/s, peak {self.best['peak_memory_bytes'] / 2**30:.2f} GiB "
            f"(every sequence {self.config.max_length} tokens; the recipe packs text into such blocks).",
            f"Model: {self.model['ref']} ({self.model['kind']})" + (
                ": a shape preset with random weights, for measuring only; pass --model with real weights"
                if self.model["kind"] in ("preset", "config") else ""),
        ]


@dataclass
class Rendered:
    text: str
    unexpressed: list[str] = field(default_factory=list)
    """Settings the target cannot express: written as comments and reported on stderr."""


def load_run(run: str | Path) -> ExportRun:
    from ..rundir import read_spec

    run_dir = Path(run)
    spec = read_spec(run_dir)
    best_path = run_dir / "best.json"
    if not best_path.is_file():
        raise UsageError(f"RUN: {run_dir} has no fitting probe (no best.json), so there is nothing to "
                         "export; run `autofit report` to see why, or search with more options.")
    best = json.loads(best_path.read_text())
    env_path = run_dir / "env.json"
    env = json.loads(env_path.read_text()) if env_path.is_file() else {}
    return ExportRun(run_dir, spec["run_id"], TrialConfig.from_dict(best["config"]), spec["model"], best, env)


def export_run(run: str | Path, fmt: str) -> Rendered:
    from . import FORMATS

    if fmt not in FORMATS:
        raise UsageError(f"--format: {fmt!r} is not known; expected one of {', '.join(FORMATS)}.")
    r = load_run(run)
    module = importlib.import_module(f".{fmt.replace('-', '_')}", __package__)
    return module.render(r)


def check_fields(cls: Any, keys: list[str] | set[str], what: str) -> None:
    """Fail at export, not at training time, when an installed library renamed an argument."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        names = set(inspect.signature(cls.__init__).parameters)
    missing = sorted(set(keys) - names)
    if missing:
        raise UsageError(f"export: the installed {what} has no field(s) {', '.join(missing)}; "
                         "the exporter was written for another version. Install the versions the run "
                         "used (see env.json) or update autofit.")


def comment_block(lines: list[str], prefix: str = "# ") -> str:
    return "\n".join(prefix + ln for ln in lines)


def yaml_recipe(r: ExportRun, body: dict[str, Any], allowed: set[str], intro: list[str],
                lost: list[str]) -> Rendered:
    """A YAML config: provenance and intro as comments, the keys, what could not be expressed."""
    import yaml

    unknown = set(body) - allowed
    assert not unknown, unknown  # the versioned key list and the exporter move together
    tail = comment_block([f"NOT EXPRESSED: {x}" for x in lost]) + "\n" if lost else ""
    text = comment_block(r.provenance() + intro) + "\n" + yaml.safe_dump(body, sort_keys=False) + tail
    return Rendered(text, lost)
