"""`autofit export` of a winner spanning several GPUs: the FSDP2 Trainer script trained for real by torchrun with
two gloo processes on the CPU (marked slow, one torchrun run); the DeepSpeed and FSDP2 settings of every format,
the files written beside a recipe and the launch commands in-process."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import run_cli
from recipes import DATA, distributed_run, imports_of, save_tiny_model, training_args

from autofit.config.spec import TrialConfig
from autofit.export import export_run
from autofit.export.script import RANK_EXIT

GUARD = """import sys
sys.modules["autofit"] = None  # the recipe must run where autofit cannot be imported
script = sys.argv[1]
sys.argv = sys.argv[1:]
exec(compile(open(script).read(), script, "exec"))
"""


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a .safetensors header (8-byte length, then JSON): no torch needed."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def test_an_fsdp2_script_trains_three_steps_sharded_under_torchrun_on_the_cpu(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    best = json.loads((run / "best.json").read_text())
    winner = TrialConfig.from_dict(best["config"])
    checkpointing = winner.gradient_checkpointing if winner.gradient_checkpointing in ("off", "on") else "on"
    cfg = winner.replace(gpus=2, engine="fsdp2", gradient_checkpointing=checkpointing)
    best["config"] = cfg.to_dict()  # accumulation and effective batch as the 2 ranks share the global batch
    (run / "best.json").write_text(json.dumps(best))
    script = tmp_path / "train.py"
    proc = run_cli("export", str(run), "-o", str(script))
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "autofit" not in imports_of(script)
    assert "torchrun --standalone --nproc-per-node 2 train.py [--model PATH]" in text
    assert "\n    fsdp_on_cpu()" in text and training_args(text)["fsdp_config"]["version"] == 2
    assert f"'gradient_accumulation_steps': {cfg.gradient_accumulation_steps}" in text
    # every rank ends its process group (PyTorch's shutdown rule) once all have saved, then leaves before Python's
    # teardown, where gloo's threads can abort it (exit -6: the run below failed in 2 of about 110 without it)
    saved, barrier = text.index("trainer.save_model(a.output_dir)"), text.index("torch.distributed.barrier()")
    assert saved < barrier < text.index("torch.distributed.destroy_process_group()")
    assert text.rstrip().endswith("    main()\n" + "\n".join(RANK_EXIT))
    (tmp_path / "guard.py").write_text(GUARD)
    out = tmp_path / "out"
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "guard.py", str(script), "--model", str(save_tiny_model(tmp_path / "model")), "--dataset",
                          str(DATA), "--output-dir", str(out),
                          "--max-steps", "3"], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert ran.returncode == 0, ran.stderr[-4000:]
    summaries = [x for x in (ran.stdout + ran.stderr).splitlines() if x.startswith("recipe-summary ")]
    assert len(summaries) == 1, summaries  # rank 0 alone
    summary = json.loads(summaries[0].split(" ", 1)[1])
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert summary["distributed_type"] == "FSDP" and summary["sharded_parameters"] > 0  # DTensor shards
    # rank 0 saved the whole adapter, gathered from the shards (FULL_STATE_DICT)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == cfg.lora_r
    shapes = safetensors_shapes(out / "adapter_model.safetensors")
    hidden = yaml.safe_load((run / "spec.yaml").read_text())["model"]["config"]["hidden_size"]
    lora_a = [s for k, s in shapes.items() if "lora_A" in k]
    assert lora_a and all(s == [cfg.lora_r, hidden] for s in lora_a), shapes


def test_what_llama_factory_cannot_express_under_zero3_is_a_comment_and_a_warning(tmp_path: Path) -> None:
    lf = export_run(distributed_run(tmp_path, method="full", engine="zero3"), "llama-factory")
    assert "pure_bf16" not in yaml.safe_load(lf.text)
    assert [x for x in lf.unexpressed if x.startswith("method=full with precision=bf16 and engine=zero3")]
    assert "# NOT EXPRESSED: method=full with precision=bf16 and engine=zero3" in lf.text
    proc = run_cli("export", str(tmp_path / "run"), "--format", "llama-factory")
    assert "warning: llama-factory cannot express method=full with precision=bf16 and engine=zero3" in proc.stderr


def test_the_cli_writes_the_deepspeed_json_beside_the_recipe_and_prints_the_launch(tmp_path: Path) -> None:
    run = distributed_run(tmp_path, engine="zero3", method="full", cpu_offload="optimizer")
    out = tmp_path / "o"
    out.mkdir()
    proc = run_cli("export", str(run), "--format", "axolotl", "-o", str(out / "a.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert f"launch: cd {out} && axolotl train a.yaml --launcher torchrun" in proc.stderr
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert yaml.safe_load((out / "a.yaml").read_text())["deepspeed"] == "ds_config.json"
