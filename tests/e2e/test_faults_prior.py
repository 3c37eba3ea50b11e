"""A card too small, and one far too large, for the model: real `autofit search` processes on the CPU (the
presets need no download; the memory limit emulates the card). Where the weights alone exceed the card for
every config of the space, the search ends before its first probe, exit 3, naming what the weights need and
the savings that would fit; a limit far above the need searches as usual."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli
from faults import Fault

from autofit.run.rundir import read_spec
from autofit.search.study import open_study, stop_reason_of

FAULTS = [
    Fault(
        "card-far-too-small",
        "a card far too small for the model: llama2-7b (12.6 GiB of bf16 weights) at "
        "2 GiB (an OverflowError traceback from the policy, exit 1)",
        "autofit search --model llama2-7b --memory-limit 2GiB",
        3,
        "Nothing was probed: nothing in the space can fit the 2 GiB limit less 5% headroom: the weights alone "
        "need 12.6 GiB (bf16 weights + LoRA adapter) in every configuration",
    ),
    Fault(
        "weights-exceed-card",
        "a card smaller than the model's weights: llama2-7b at 8 GiB (at 6 GiB: probed a config "
        "the prior knew could not fit, then 'no probe finished')",
        "autofit search --model llama2-7b --memory-limit 8GiB",
        3,
        "Would fit, by the memory model: a 4-bit base (QLoRA, --space qlora): weights 4.1 GiB",
    ),
    Fault(
        "card-far-too-large",
        "a limit far above the need: tiny-llama at 10 TiB",
        "autofit search --model tiny-llama --memory-limit 10TiB",
        0,
        "stopped: no remaining configuration can win; 1 probe",
    ),
]
ROW = {f.id: f for f in FAULTS}
ONE_CONFIG = """\
method: lora
fixed: {max_length: 32, global_batch: 1, lora_r: 4, lora_alpha: 8, precision: bf16, optimizer: adamw_torch}
dimensions: {micro_batch_size: [1], gradient_checkpointing: ["off"]}
"""


def search(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`autofit search ... --device cpu` in its own out folder."""
    return run_cli("search", *args, "--device", "cpu", "--budget", "5m", "--out", str(tmp_path / "runs"), timeout=300)


@pytest.mark.parametrize("fault_id, limit", [("card-far-too-small", "2GiB"), ("weights-exceed-card", "8GiB")])
def test_a_card_the_weights_alone_exceed_ends_before_any_probe_with_the_savings(
    tmp_path: Path, fault_id: str, limit: str
) -> None:
    proc = search(tmp_path, "--model", "llama2-7b", "--memory-limit", limit, "--json")
    assert proc.returncode == ROW[fault_id].exit_code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("autofit: error:")]
    assert len(error) == 1, proc.stderr  # one line
    assert ROW[fault_id].message in error[0]
    assert (
        f"nothing in the space can fit the {limit[:-3]} GiB limit less 5% headroom: the weights alone need "
        "12.6 GiB (bf16 weights + LoRA adapter) in every configuration"
    ) in error[0]
    assert "a smaller model of at most" in error[0] and "a card with" in error[0]
    if limit == "8GiB":
        assert "sharded with" in error[0]
    run_dir = Path(json.loads(proc.stdout)["run_dir"])
    spec = read_spec(run_dir)
    study = open_study(spec["storage"], spec["study_name"], create=False, seed=0)
    assert study.get_trials() == [] and stop_reason_of(study).startswith("nothing in the space can fit")
    assert not list(run_dir.glob("logs/*")), "a probe ran"  # no probe log, no probe process


def test_a_limit_far_above_the_need_searches_as_usual(tmp_path: Path) -> None:
    """One config of tiny-llama under 10 TiB: P(fit) 1, probed, the winner (no standby: one probe only)."""
    space = tmp_path / "one.yaml"
    space.write_text(ONE_CONFIG)
    proc = search(
        tmp_path,
        "--model",
        "tiny-llama",
        "--space",
        str(space),
        "--memory-limit",
        "10TiB",
        "--confirm",
        "0",
        "--standby",
        "0",
    )
    assert proc.returncode == ROW["card-far-too-large"].exit_code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert ROW["card-far-too-large"].message in proc.stdout and "L=32 mb=1" in proc.stdout
