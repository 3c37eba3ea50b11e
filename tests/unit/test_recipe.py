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
    """The emulated memory cap (a flag and its lines) and the one-line warnings of what the format does otherwise
    than the probe are the only things beyond MAX_LINES."""
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
        differs = sum(line.startswith("# DIFFERS FROM THE PROBE") for line in lines)  # warnings, one line each
        assert len(lines) - emulation - differs <= allowed, (strategy, len(lines), emulation, differs)


@pytest.mark.parametrize("reference", ["shared", "copy"])
def test_a_dpo_recipe_is_short_and_passes_the_reference_as_measured(tmp_path: Path, reference: str) -> None:
    """trl's DPO recipe (tests/e2e/test_export_dpo.py trains it): within MAX_LINES beside its memory cap, the
    reference as dpo_reference says (shared: no ref_model, TRL disables the adapter; copy: a second model)."""
    from recipes import training_args

    run = data_run(tmp_path, "pad_max")
    best = json.loads((run / "best.json").read_text())
    best["config"].update(trainer="dpo", dpo_reference=reference)
    (run / "best.json").write_text(json.dumps(best))
    rendered = export_run(run, "trl")
    lines = rendered.text.splitlines()
    assert len(lines) - sum("emulate" in x or "torch.cuda.mem_get_info()" in x or "outside" in x or "torch.zeros(1"
                            in x for x in lines) <= MAX_LINES
    assert ("ref_model=reference" in rendered.text) is (reference == "copy")
    assert ("ref_model=None" in rendered.text) is (reference == "shared") and "DPOConfig(output_dir" in rendered.text
    fields = training_args(rendered.text)
    assert (fields["pad_to_multiple_of"], fields["max_length"], fields["precompute_ref_log_probs"]) == (96, 96, False)
    assert not rendered.unexpressed
