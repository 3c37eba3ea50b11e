"""Search spaces: `search_spaces/*.yaml` loaded and validated into dimensions.

A space has `fixed` settings (one value each) and `dimensions` (a list of allowed values
each); every key is a TrialConfig key. A malformed space lists every problem at once,
naming the file, the key and the value.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autofit.config.spec import KEYS, TrialConfig, Value
from autofit.core import paths
from autofit.core.errors import UsageError

SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"
# Checkpointing and quantization ordered from cheapest to most expensive in time: with the
# rest equal, a later value is never faster (more recomputation, offload copies, dequantising).
CKPT_COST = ("off", "every_4", "every_3", "every_2", "on", "every_4+offload", "every_2+offload", "on+offload")
QUANT_COST = ("none", "nf4", "8bit")


@dataclass(frozen=True)
class Space:
    name: str
    fixed: dict[str, Value]
    dimensions: dict[str, list[Value]]
    source: str = ""
    divisors_only: bool = False
    """Only micro-batch sizes whose batch over every rank (micro_batch_size x gpus) divides global_batch
    (keeps the effective batch exact)."""
    notes: dict[str, str] = field(default_factory=dict)

    def values(self, key: str) -> list[Value]:
        if key in self.dimensions:
            return list(self.dimensions[key])
        value = self.fixed.get(key, KEYS[key].default)
        return [] if value is None else [value]

    @property
    def lengths(self) -> list[int]:
        """Allowed max_length values, longest first."""
        return sorted((int(v) for v in self.values("max_length")), reverse=True)

    def config(self, params: Mapping[str, Value]) -> TrialConfig:
        return TrialConfig.from_mapping({**self.fixed, **params}, source=self.source or self.name)

    def allowed(self, cfg: TrialConfig) -> bool:
        """A micro-batch (over every rank) no larger than the global batch: a larger one trains more
        sequences per step than asked (micro-batch 4 at global batch 2 would step on 4); with
        `divisors_only`, only those that divide it."""
        per_step = cfg.micro_step_sequences
        return per_step <= cfg.global_batch and (not self.divisors_only or cfg.global_batch % per_step == 0)

    def lora_targets(self) -> list[str]:
        """The lora_targets its LoRA configurations adapt (each distinct value once)."""
        return list(dict.fromkeys(c.lora_targets for c in self.candidates() if c.method == "lora"))

    def candidates(self) -> list[TrialConfig]:
        """Every configuration of the space (the exhaustive grid)."""
        keys = list(self.dimensions)
        out = []
        for combo in itertools.product(*(self.dimensions[k] for k in keys)):
            try:
                cfg = self.config(dict(zip(keys, combo)))
            except UsageError:
                continue  # an invalid combination (full + nf4): not a candidate
            if self.allowed(cfg):
                out.append(cfg)
        return out

    def seed(self) -> dict[str, Value]:
        """The first probe: the common forum recipe (micro-batch 1, checkpointing on, bf16, the longest
        length), which fits wherever anything does. On a dataset its samples packed (`packed`, else
        `padding_free`, else dynamic padding): the same worst-case row as padding to max_length, so it
        fits as surely, and no compute spent on padding. A padded first probe on short samples runs
        a tenth as fast and can take a short budget's first minute (measured: 60 s of 150 s)."""
        prefs: dict[str, tuple[Value, ...]] = {
            "micro_batch_size": (1,), "gradient_checkpointing": ("on",), "precision": ("bf16",),
            "max_length": (self.lengths[0],), "batching": ("packed", "padding_free", "pad_longest")}
        out: dict[str, Value] = {}
        for k, vals in self.dimensions.items():
            want = next((v for v in prefs.get(k, ()) if v in vals), None)
            out[k] = want if want is not None else (min(map(int, vals)) if k == "micro_batch_size"
                                                    else vals[0])
        return out

    def warnings(self) -> list[str]:
        """What a person should hear before a search of this space (nothing is wrong enough to stop)."""
        where = self.source or self.name
        if not self.dimensions:
            return [(f"{where}: the space has no dimensions: the search probes one configuration (the fixed "
                    "settings, defaults for the rest) and stops; list values under `dimensions:` to search.")]
        return []

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "source": self.source, "fixed": self.fixed,
                "dimensions": self.dimensions, "divisors_only": self.divisors_only}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Space:
        """The inverse of `to_dict` (not validated: `validate` says what is wrong)."""
        return cls(d["name"], dict(d["fixed"]), {k: list(v) for k, v in d["dimensions"].items()},
                   d.get("source", ""), bool(d.get("divisors_only", False)))

    def replaced(self, **dims: Sequence[Value]) -> Space:
        """The space with some dimensions replaced (--max-length, --global-batch); a bad value names
        its flag, not the space file."""
        problems = []
        for k, vals in dims.items():
            flag = OVERRIDE_FLAGS.get(k)
            if flag is not None and len(set(map(str, vals))) != len(vals):
                problems.append(f"{flag}: a value is listed twice in {','.join(map(str, vals))}; list each "
                                "once.")
            problems += [f"{flag}: {msg}" for v in vals if flag is not None and (msg := KEYS[k].problem(v))]
        if problems:
            raise UsageError(problems)
        fixed, dimensions = dict(self.fixed), dict(self.dimensions)
        for k, vals in dims.items():
            fixed.pop(k, None)
            dimensions.pop(k, None)
            if len(vals) == 1:
                fixed[k] = vals[0]
            else:
                dimensions[k] = list(vals)
        space = Space(self.name, fixed, dimensions, self.source, self.divisors_only, self.notes)
        validate(space)
        return space


OVERRIDE_FLAGS = {"max_length": "--max-length", "global_batch": "--global-batch"}
"""The search flags that replace a space's dimension."""


def validate(space: Space) -> None:
    """Every problem of a space at once."""
    where = space.source or space.name
    problems = []
    # what a spec.yaml or a space file held, not yet checked: any value YAML can give
    sections: tuple[tuple[str, Mapping[str, object]], ...] = (
        ("fixed", {k: [v] for k, v in space.fixed.items()}), ("dimensions", space.dimensions))
    for section, items in sections:
        for key, vals in items.items():
            if key not in KEYS:
                problems.append(f"{where}: {section}.{key}: unknown key; known keys: {', '.join(KEYS)}")
                continue
            if not isinstance(vals, list) or not vals:
                problems.append(f"{where}: {section}.{key}: expected a non-empty list of values, got "
                                f"{vals!r}")
                continue
            for v in vals:
                if isinstance(v, str) and KEYS[key].type is not str:
                    try:
                        v = KEYS[key].parse(v)
                    except ValueError:
                        pass
                if key == "lora_dropout" and isinstance(v, float):
                    v = repr(v)
                msg = KEYS[key].problem(v)
                if msg:
                    problems.append(f"{where}: {section}.{key}: {msg}")
            if len(set(map(str, vals))) != len(vals):
                problems.append(f"{where}: {section}.{key}: a value is listed twice in {vals!r}")
    both = set(space.fixed) & set(space.dimensions)
    problems += [f"{where}: {k} is both fixed and a dimension; keep one" for k in sorted(both)]
    if not problems and not space.candidates():
        problems.append(f"{where}: no valid configuration: every combination breaks a rule (a micro-batch "
                        "larger than the global batch; with divisors_only, one that does not divide it; "
                        "quantization with method: full). Allow smaller micro-batches or a larger global "
                        "batch (--global-batch).")
    if problems:
        raise UsageError(problems)


def _normal(key: str, value: Any) -> Any:
    """YAML reads `off`/`on` as booleans and 0.05 as a float: give string keys their strings."""
    k = KEYS.get(key)
    if k is None or k.type is not str:
        return value
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)):
        return repr(float(value)) if key == "lora_dropout" else str(value)
    return value


def shipped_spaces() -> list[str]:
    """The names `--space` takes besides a path."""
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently, so
    a dimension listed twice lost its first list)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:  # yaml's own
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"a key that is a list or a mapping "
                                                        f"({key!r})", key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        where = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}"
        return f"{e.problem} ({where}{'; ' + e.context if e.context else ''})"
    return " ".join(str(e).split())


def load_space(ref: str | Path) -> Space:
    """A space by name (`lora`) or path (`my.yaml`)."""
    path = Path(ref)
    paths.source(path, "--space", f"Give a YAML path or a shipped space ({', '.join(shipped_spaces())}).")
    if not path.suffix and not path.exists():
        path = SPACES_DIR / f"{ref}.yaml"
    if not path.is_file():
        have = ", ".join(shipped_spaces())
        what = f"{ref} is a folder, not a file" if path.is_dir() else f"no such file {ref}"
        raise UsageError(f"--space: {what}; give a YAML path or a shipped space ({have}).")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"),
                         Loader=_UniqueKeyLoader)  # noqa: S506  a SafeLoader
    except yaml.YAMLError as e:
        raise UsageError(f"--space: {path} is not valid YAML: {_yaml_problem(e)}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UsageError(f"--space: cannot read {path} as UTF-8 text ({e}); give a YAML space "
                         "file.") from None
    if not isinstance(data, dict):
        raise UsageError(f"--space: {path}: expected a mapping with 'fixed' and 'dimensions'.")
    problems = [f"{path}: unknown section {k!r}; expected fixed, dimensions, divisors_only, method"
                for k in data if k not in ("fixed", "dimensions", "divisors_only", "method")]
    fixed = data.get("fixed") or {}
    dims = data.get("dimensions") or {}
    if not isinstance(fixed, dict) or not isinstance(dims, dict):
        problems.append(f"{path}: 'fixed' and 'dimensions' must be mappings of key: value(s).")
        raise UsageError(problems)
    if "method" in data:
        fixed = {"method": data["method"], **fixed}
    fixed = {k: _normal(k, v) for k, v in fixed.items()}
    dims = {k: [_normal(k, x) for x in v] if isinstance(v, list) else v for k, v in dims.items()}
    divisors_only = data.get("divisors_only", False)
    if not isinstance(divisors_only, bool):
        problems.append(f"{path}: divisors_only: {divisors_only!r} is not true or false.")
        divisors_only = False
    space = Space(path.stem, dict(fixed), dims, str(path), divisors_only)
    try:
        validate(space)
    except UsageError as e:
        raise UsageError(problems + e.problems) from None
    if problems:
        raise UsageError(problems)
    return space
