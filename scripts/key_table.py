#!/usr/bin/env python3
"""Print the configuration keys as the docs' table, from their one declaration (`autofit.config.spec.KEYS`).

Each row is one `Dimension`: its default, its allowed values, whether it changes what is learned, how it moves
memory (the memory model's class), which shipped search spaces search it, and the TrainingArguments field it
maps to where it is declared with one. docs/probe.md carries the output; tests/test_docs.py checks that it
does. Run: python scripts/key_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autofit.config.space import load_space, shipped_spaces  # noqa: E402  after the path above
from autofit.config.spec import KEYS, Dimension  # noqa: E402

HEADER = ("| key | default | allowed values | changes what is learned | memory | searched by | "
          "TrainingArguments field | what it is |")


def shown(value: object) -> str:
    """A value as a space file or `--set` writes it (YAML's lower-case booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def allowed(d: Dimension) -> str:
    if d.allowed is not None:
        return ", ".join(shown(v) for v in d.allowed)
    if d.type is bool:
        return "true, false"
    return d.expected or d.type.__name__


def searched_by() -> dict[str, list[str]]:
    """Each key's shipped spaces that list it under `dimensions`."""
    out: dict[str, list[str]] = {name: [] for name in KEYS}
    for space in shipped_spaces():
        for name in load_space(space).dimensions:
            out[name].append(space)
    return out


def row(d: Dimension, spaces: list[str]) -> str:
    field = f"`{d.training_argument}`" if d.training_argument else ""
    cells = [f"`{d.name}`", f"`{shown(d.default)}`", allowed(d), "yes" if d.learning else "", d.memory.value,
             ", ".join(spaces), field, d.help]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def main() -> int:
    spaces = searched_by()
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|")
    for name, d in KEYS.items():
        print(row(d, spaces[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
