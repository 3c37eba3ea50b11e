"""`empty_cache_steps`, the dimension added through its declaration alone: TrainingArguments'
`torch_empty_cache_steps`, probed for real, spelled by the recipes that take it, listed as not kept by axolotl,
an allocator setting to the memory model."""

from __future__ import annotations

from pathlib import Path

from conftest import probe_json


def test_a_probe_trains_with_it(tmp_path: Path) -> None:
    res = probe_json("--set", "max_length=32", "--set", "global_batch=2", "--set", "empty_cache_steps=1", cwd=tmp_path)
    assert res["outcome"] == "fit" and res["config"]["empty_cache_steps"] == 1, res.get("reason")
