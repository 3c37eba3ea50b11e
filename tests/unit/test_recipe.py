"""The exported Python recipes a user keeps (issue 33): a LoRA or QLoRA recipe of a run searched on a dataset is
short, for every batching strategy and both formats (rendered in-process; tests/e2e/test_recipe.py trains them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.config.spec import BATCHINGS
from autofit.export import export_run
from runs import data_run

MAX_LINES = 120
"""What a LoRA recipe with a dataset may take, its emulated memory cap aside; a quantized base adds its
QUANTIZATION and KBIT_PREPARATION constants, their call and the device map of the loading (QLORA_LINES)."""
QLORA_LINES = 5
HF_TOKENIZING = 2
"""hf-trainer tokenizes the rows itself (TRL's SFTTrainer does it inside): its map and the pad token."""


@pytest.mark.parametrize("fmt", ["trl", "hf-trainer"])
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_a_lora_recipe_with_a_dataset_stays_short(tmp_path: Path, fmt: str, quantization: str) -> None:
    """The emulated memory cap (a flag and its lines) is the only thing beyond MAX_LINES."""
    for strategy in BATCHINGS:
        run = data_run(tmp_path / f"{strategy}-{fmt}-{quantization}", strategy)
        best = json.loads((run / "best.json").read_text())
        best["config"]["quantization"] = quantization
        (run / "best.json").write_text(json.dumps(best))
        lines = export_run(run, fmt).text.splitlines()
        cap = next(i for i, line in enumerate(lines) if line.startswith("    if a.emulate_memory_gib and"))
        block = next(i for i in range(cap, len(lines)) if "set_per_process_memory_fraction" in lines[i]) - cap + 1
        emulation = block + sum("emulate" in line for line in lines[:cap])  # the flag and its check
        allowed = MAX_LINES + (QLORA_LINES if quantization != "none" else 0) + (HF_TOKENIZING if fmt != "trl" else 0)
        assert len(lines) - emulation <= allowed, (strategy, len(lines), emulation)
