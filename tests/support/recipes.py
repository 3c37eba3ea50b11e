"""What the tests of exported recipes share: the dataset they train on, and a recipe read as text (the
modules it imports, its TRAINING_ARGS literal)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from conftest import DATA_DIR

from autofit.config.spec import TrialConfig
from runs import write_run

DATA = DATA_DIR / "tiny.jsonl"
"""A few lines of text: enough rows for a recipe's three steps."""


def imports_of(path: Path) -> set[str]:
    """The top-level modules a script imports, anywhere in it."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def training_args(script: str) -> dict[str, Any]:
    """TRAINING_ARGS of an exported Python recipe, read as the literal it is."""
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TRAINING_ARGS":
            return ast.literal_eval(node.value)
    raise AssertionError("no TRAINING_ARGS in the recipe")


def distributed_run(tmp_path: Path, **settings: Any) -> Path:
    """A run folder whose winner spans several GPUs (a small valid config of tiny-llama)."""
    cfg = TrialConfig(max_length=128, micro_batch_size=2, global_batch=8, gpus=2, **settings)
    return write_run(tmp_path / "run", config=cfg.to_dict())
