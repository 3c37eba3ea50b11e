"""`autofit export` of a winner spanning several GPUs: the FSDP2 Trainer script trained for real by torchrun with
two gloo processes on the CPU (marked slow, one torchrun run); the DeepSpeed and FSDP2 settings of every format,
the files written beside a recipe and the launch commands in-process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from recipes import DATA, distributed_run, training_args

from autofit.config import distributed
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.data import DatasetRef, load_samples
from autofit.export import export_run, stdout_notes, write_rendered
from autofit.export.common import check_fields
from autofit.export.multi_gpu import ACCELERATE_FSDP, DEEPSPEED_JSON
from autofit.export.yaml_targets import ACCELERATE, AXOLOTL, LLAMA_FACTORY
from runs import write_run


def test_zero3_with_offload_in_every_format(tmp_path: Path) -> None:
    run = distributed_run(tmp_path, method="full", engine="zero3", cpu_offload="all")
    script = export_run(run, "hf-trainer")
    zero = training_args(script.text)["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert "torchrun --standalone --nproc-per-node 2 train.py" in script.text
    assert "DeepSpeed ZeRO stage 3" in script.text
    assert "fsdp_on_cpu" not in script.text and script.companions == {}  # the JSON is embedded
    assert script.launch_for("t.py") == ("OMP_NUM_THREADS=$(( $(nproc) / 2 )) torchrun --standalone --nproc-per-node 2 "
                                         "t.py --dataset data.jsonl --output-dir out")  # the CPU step's cores
    trl = export_run(run, "trl")
    assert training_args(trl.text)["deepspeed"] == training_args(script.text)["deepspeed"]
    for fmt, launch in [("axolotl", "axolotl train this.yaml --launcher torchrun -- --nproc_per_node=2 --nnodes=1"),
                        ("llama-factory", "FORCE_TORCHRUN=1 NPROC_PER_NODE=2 llamafactory-cli train this.yaml")]:
        r = export_run(run, fmt)
        assert yaml.safe_load(r.text)["deepspeed"] == DEEPSPEED_JSON, fmt
        assert json.loads(r.companions[DEEPSPEED_JSON]) == distributed.deepspeed_config(TrialConfig.from_dict(
            json.loads((run / "best.json").read_text())["config"]))
        assert f"Run: {launch}" in r.text and "2 GPUs, zero3 (offload all)" in r.text, fmt
        assert r.launch_for("this.yaml") == launch


def test_fsdp2_in_the_yaml_formats(tmp_path: Path) -> None:
    run = distributed_run(tmp_path, engine="fsdp2", reshard_after_forward=False, gradient_checkpointing="on")
    ax = export_run(run, "axolotl")
    doc = yaml.safe_load(ax.text)
    assert doc["fsdp_version"] == 2 and set(doc["fsdp_config"]) <= AXOLOTL["fsdp_config"]
    assert doc["fsdp_config"]["reshard_after_forward"] is False and doc["fsdp_config"]["activation_checkpointing"]
    assert doc["gradient_checkpointing"] is False  # FSDP's own checkpointing replaces axolotl's
    assert set(doc) <= AXOLOTL["keys"] and ax.companions == {} and ax.unexpressed == []
    lf = export_run(run, "llama-factory")
    assert set(yaml.safe_load(lf.text)) <= LLAMA_FACTORY["keys"]
    assert yaml.safe_load(lf.text)["disable_gradient_checkpointing"] is True
    acc = yaml.safe_load(lf.companions[ACCELERATE_FSDP])
    assert acc["fsdp_config"]["fsdp_version"] == 2 and acc["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert acc["fsdp_config"]["fsdp_activation_checkpointing"] is True and acc["num_processes"] == 2
    launch = f"accelerate launch --config_file {ACCELERATE_FSDP} -m llamafactory.launcher l.yaml"
    assert lf.launch_for("l.yaml") == launch
    assert "Run: accelerate launch" in lf.text


def test_companions_are_written_beside_the_recipe_and_the_launch_is_said(tmp_path: Path) -> None:
    run = distributed_run(tmp_path, engine="zero2")
    r = export_run(run, "axolotl")
    out = tmp_path / "recipes" / "a.yaml"
    out.parent.mkdir()
    lines = write_rendered(r, out, force=False, executable=False, run_dir=run)
    assert lines[:2] == [f"wrote {out}", f"wrote {out.parent / DEEPSPEED_JSON}"]
    assert lines[2] == (f"launch: cd {out.parent} && axolotl train a.yaml --launcher torchrun -- "
                        "--nproc_per_node=2 --nnodes=1")
    assert json.loads((out.parent / DEEPSPEED_JSON).read_text())["zero_optimization"]["stage"] == 2
    lf = export_run(tmp_path / "run", "llama-factory")  # the same JSON: kept, no --force needed
    written = write_rendered(lf, out.parent / "l.yaml", force=False, executable=False, run_dir=run)
    assert written[1] == f"wrote {out.parent / DEEPSPEED_JSON}"
    (out.parent / DEEPSPEED_JSON).write_text("{}  edited\n")
    with pytest.raises(UsageError, match=f"-o: {out.parent / DEEPSPEED_JSON} already exists with other content"):
        write_rendered(r, tmp_path / "recipes" / "b.yaml", force=False, executable=False, run_dir=run)
    assert not (tmp_path / "recipes" / "b.yaml").exists() and "edited" in (out.parent / DEEPSPEED_JSON).read_text()
    write_rendered(r, tmp_path / "recipes" / "b.yaml", force=True, executable=False, run_dir=run)
    assert "edited" not in (out.parent / DEEPSPEED_JSON).read_text()
    with pytest.raises(UsageError, match=f"-o: .*{DEEPSPEED_JSON} is the name of the file the recipe names beside"):
        write_rendered(r, out.parent / DEEPSPEED_JSON, force=True, executable=False, run_dir=run)  # one would be lost
    assert stdout_notes(r, "axolotl.yaml") == [
        f"the recipe names {DEEPSPEED_JSON}, written beside it only with -o: export again with -o FILE to get it",
        "launch: axolotl train axolotl.yaml --launcher torchrun -- --nproc_per_node=2 --nnodes=1"]


@pytest.mark.parametrize("fmt, launch", [
    ("hf-trainer", "torchrun --standalone --nproc-per-node 2 train.py [--model PATH]"),
    ("trl", "torchrun --standalone --nproc-per-node 2 train_trl.py [--model PATH]"),
    ("axolotl", "axolotl train this.yaml --launcher torchrun -- --nproc_per_node=2 --nnodes=1"),
    ("llama-factory", "FORCE_TORCHRUN=1 NPROC_PER_NODE=2 llamafactory-cli train this.yaml"),
])
def test_plain_data_parallel_is_launched_on_every_gpu(tmp_path: Path, fmt: str, launch: str) -> None:
    r = export_run(distributed_run(tmp_path), fmt)
    assert launch in r.text and "2 GPUs, data parallel" in r.text and r.companions == {}
    keys = training_args(r.text) if fmt in ("hf-trainer", "trl") else yaml.safe_load(r.text)
    assert not {"fsdp", "fsdp_config", "fsdp_version", "deepspeed"} & set(keys)
    assert "fsdp_on_cpu" not in r.text


def test_one_gpu_recipes_are_as_before(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    for fmt in ("hf-trainer", "axolotl", "llama-factory"):
        r = export_run(run, fmt)
        assert r.launch == "" and r.companions == {} and "GPUs" not in r.text, fmt
    text = export_run(run, "hf-trainer").text
    assert "torchrun" not in text and "world_size" not in text  # one process: no group in its summary
    assert "fsdp_on_cpu" not in text and "'fsdp'" not in text


@pytest.mark.parametrize("fmt", ["hf-trainer", "trl"])
@pytest.mark.parametrize("strategy", [None, "packed"])
def test_every_python_recipe_calls_the_cpu_shim_before_its_trainer(tmp_path: Path, fmt: str,
                                                                    strategy: str | None) -> None:
    """FSDP2 on gloo ranks (a CPU) needs fsdp_on_cpu() after the arguments and before the trainer; a run
    searched on a dataset (packed) and one without, in both formats."""
    run = distributed_run(tmp_path, engine="fsdp2")
    if strategy:
        spec = yaml.safe_load((run / "spec.yaml").read_text())
        spec["dataset"] = DatasetRef.of(load_samples(DATA)).to_dict()
        (run / "spec.yaml").write_text(yaml.safe_dump(spec))
        best = json.loads((run / "best.json").read_text())
        best["config"]["batching"] = strategy
        (run / "best.json").write_text(json.dumps(best))
    text = export_run(run, fmt).text
    arguments = "TrainingArguments(" if fmt == "hf-trainer" else "SFTConfig("
    assert text.index("def fsdp_on_cpu") < text.index(arguments) < text.index("    fsdp_on_cpu()") < text.index(
        "    trainer = ")
    assert "all_reduce" in text and '"world_size": args.world_size' in text  # the group's tokens, rank 0 says
    assert "fsdp_on_cpu" not in export_run(distributed_run(tmp_path / "ddp"), fmt).text


def test_the_engine_key_lists_match_the_installed_libraries() -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    from autofit.export.fields import installed_fields

    assert ACCELERATE["keys"] <= {f.name for f in dataclasses.fields(ClusterConfig)}
    assert ACCELERATE["fsdp_config"] <= {a.dest for a in launch_command_parser()._actions}
    documented = installed_fields()["fsdp_config"]
    assert set(distributed.training_arguments(TrialConfig(gpus=2, engine="fsdp2"))["fsdp_config"]) <= documented
    with pytest.raises(UsageError, match="no field.*offload_params"):  # FSDP1's name: silently ignored by .get
        check_fields(documented, {"version", "offload_params"}, "TrainingArguments fsdp_config")
