"""The exported Python recipes a user keeps (issue 33): for each batching strategy the `trl` recipe of a run
searched on a dataset trains 3 steps on the CPU in a process of its own, where autofit cannot be imported;
the `hf-trainer` recipe too (packed, its longest path).

The runs are written (`runs.data_run`: tiny-llama, max_length 96, micro-batch 2, accumulation 2); the model is
tiny-llama's shape saved once with a tokenizer, as a user's model folder is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from recipes import imports_of, save_tiny_model, training_args

from autofit.config.spec import BATCHINGS
from autofit.export import export_run
from runs import data_run

GUARD = ("import sys; sys.modules['autofit'] = None; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
         "exec(compile(open(script).read(), script, 'exec'))")
"""Runs a recipe where `import autofit` fails: it must need nothing of autofit."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model"))


def run_recipe(script: Path, model: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The recipe for 3 optimizer steps on `model`, and its summary."""
    out = script.parent / "out"
    proc = subprocess.run([sys.executable, "-c", GUARD, str(script), "--model", str(model), "--output-dir", str(out),
                           "--max-steps", "3", *args], check=False, capture_output=True, text=True,
                          cwd=script.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("recipe-summary ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    assert (out / "adapter_config.json").is_file()
    return proc, json.loads(lines[0].split(" ", 1)[1])


def exported(tmp_path: Path, strategy: str, fmt: str) -> tuple[Path, str]:
    run = data_run(tmp_path, strategy)
    script = tmp_path / ("train_trl.py" if fmt == "trl" else "train.py")
    script.write_text(export_run(run, fmt).text)
    assert "autofit" not in imports_of(script)
    return script, script.read_text()


@pytest.mark.parametrize("strategy", BATCHINGS)
def test_the_trl_recipe_trains_three_steps_with_each_strategy(model: Path, tmp_path: Path, strategy: str) -> None:
    script, text = exported(tmp_path, strategy, "trl")
    fields = training_args(text)
    assert fields["per_device_train_batch_size"] == 2 and fields["gradient_accumulation_steps"] == 2
    assert fields["max_length"] == (None if strategy == "padding_free" else 96)
    assert (fields["packing"], fields.get("packing_strategy")) == (
        (True, "bfd") if strategy == "packed" else (False, None))
    assert fields.get("padding_free", False) is (strategy == "padding_free")  # bfd packing is padding-free itself
    assert fields.get("pad_to_multiple_of") == (96 if strategy == "pad_max" else None)
    assert fields.get("train_sampling_strategy") == ("group_by_length" if strategy == "group_by_length" else None)
    _, summary = run_recipe(script, model)
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
    assert summary["tokens_per_s"] == pytest.approx(summary["steady_tokens"] / summary["steady_seconds"])
    # one steady step: micro-batch 2 x accumulation 2 of D1's samples (mean ~60 tokens), each cut to 96
    rows = 4 if strategy != "packed" else 4 * 96 // 60
    assert 0 < summary["steady_tokens"] <= rows * 95, summary
    if strategy == "pad_max":  # padded to 96, yet only the samples' own tokens count
        assert summary["steady_tokens"] < 4 * 95


@pytest.mark.parametrize("strategy", ["packed", "padding_free"])
def test_the_hf_trainer_recipe_trains_three_steps(model: Path, tmp_path: Path, strategy: str) -> None:
    """hf-trainer's own paths: TRL's pack_dataset bins flattened by TRL's collator; micro_batch_size samples
    flattened by transformers' DataCollatorWithFlattening (the padded strategies are trl's above, with the same
    collator arguments checked in-process)."""
    script, text = exported(tmp_path, strategy, "hf-trainer")
    _, summary = run_recipe(script, model)
    assert summary["steps"] == 3
    assert summary["tokens_per_s"] == pytest.approx(summary["steady_tokens"] / summary["steady_seconds"])
    if strategy == "packed":
        assert "pack_dataset(data, MAX_LENGTH" in text and "padding_free=True" in text
        assert 4 * 60 < summary["steady_tokens"] <= 4 * 95  # full rows, not one sample a row
    else:  # one step: 2 micro-batches of 2 samples, each cut to 96
        assert "DataCollatorWithFlattening()" in text and 0 < summary["steady_tokens"] <= 4 * 95
