"""`empty_cache_steps`, the dimension added through its declaration alone: TrainingArguments'
`torch_empty_cache_steps`, probed for real, spelled by the recipes that take it, listed as not kept by axolotl,
an allocator setting to the memory model."""

from __future__ import annotations

from pathlib import Path

from autofit.config import recipe
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.estimate.memory import MemoryModel, Shape
from autofit.export import export_run
from runs import write_run


def test_it_reaches_trainer_as_torch_empty_cache_steps_and_zero_is_never() -> None:
    from transformers import TrainingArguments

    args = recipe.training_arguments(TrialConfig(empty_cache_steps=2), on_cpu=True, max_steps=3)
    assert args["torch_empty_cache_steps"] == 2
    assert TrainingArguments(output_dir="unused", **args).torch_empty_cache_steps == 2
    assert "torch_empty_cache_steps" not in recipe.training_arguments(TrialConfig(), on_cpu=True, max_steps=3)
    assert TrialConfig().key() == TrialConfig(empty_cache_steps=0).key()  # a stored study keeps its keys
    assert "empty_cache_steps=4" in TrialConfig(empty_cache_steps=4).key()


def test_each_format_spells_it_or_says_it_is_not_kept(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", config=TrialConfig(empty_cache_steps=1).to_dict())
    assert "'torch_empty_cache_steps': 1" in export_run(run, "hf-trainer").text
    assert "'torch_empty_cache_steps': 1" in export_run(run, "trl").text
    assert "torch_empty_cache_steps: 1" in export_run(run, "llama-factory").text
    axolotl = export_run(run, "axolotl")
    assert "torch_empty_cache_steps" not in axolotl.text.split("NOT EXPRESSED")[0]
    assert axolotl.unexpressed == ["empty_cache_steps=1: axolotl takes no torch_empty_cache_steps"]


def test_handing_memory_back_more_often_can_save_what_was_reserved_but_unallocated() -> None:
    model = MemoryModel(Shape.from_config(resolve_model("llama2-7b").config))
    oom = TrialConfig(micro_batch_size=4)
    assert model.max_saving(oom, oom.replace(empty_cache_steps=1), reserved_free=512 * 2**20) == 512 * 2**20
    assert model.max_saving(oom.replace(empty_cache_steps=1), oom, reserved_free=512 * 2**20) == 0
