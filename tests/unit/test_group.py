"""Probes spanning several ranks: real torchrun, real FSDP2 over gloo on the CPU, and ranks that fail.

A faulty rank is tests/fake_rank.py (started by the real torchrun in place of one rank): it raises,
prints the real CUDA out-of-memory text, or hangs; the other rank is the real probe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autofit.config import distributed
from autofit.config.space import Space
from autofit.config.spec import TrialConfig
from autofit.config.target import Target, resolve_targets
from autofit.core.errors import UsageError
from autofit.probe.runner import Runner
from autofit.protocol.group import merge, root_cause
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.lines import ranks_line

CFG = TrialConfig(max_length=64, global_batch=8, micro_batch_size=2, precision="fp32", gpus=2)


# ----------------------------------------------------------------------------- judged without a launch


def test_what_a_machine_cannot_run_is_unsupported_before_anything_starts(tmp_path: Path) -> None:
    two_gpus = Target("cuda", 0, "H200", gpu_indices=(0, 1), ranks=2)
    runner = Runner(two_gpus, tmp_path, standby=0)
    assert "2 GPU(s) attached" in runner.judged_before(CFG.replace(gpus=4)).reason
    assert runner.judged_before(CFG) is None
    zero = runner.judged_before(CFG.replace(engine="zero3", method="full"))
    assert zero.outcome is Outcome.UNSUPPORTED and "deepspeed is not installed" in zero.reason
    cpu = Runner(Target(), tmp_path, standby=0, dataset={"path": "d.jsonl"})
    assert "with --dataset" in cpu.judged_before(CFG).reason
    assert "no device memory" in Runner(Target(), tmp_path).judged_before(
        CFG.replace(engine="fsdp2", cpu_offload="all")).reason


def test_engine_rules_and_gpus_flags_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="cpu_offload=optimizer is not available with engine=fsdp2"):
        TrialConfig(engine="fsdp2", cpu_offload="optimizer")
    with pytest.raises(UsageError, match="FSDP's own activation_checkpointing"):
        TrialConfig(engine="fsdp2", gradient_checkpointing="every_2")
    with pytest.raises(UsageError, match="--gpus: 0"):
        resolve_targets(None, "cpu", None, per_probe=0)
    (cpu,) = resolve_targets(None, "cpu", None, per_probe=2)
    assert cpu.ranks == 2 and "2 processes (gloo)" in cpu.describe()
    assert TrialConfig(gpus=4, global_batch=16, micro_batch_size=2).gradient_accumulation_steps == 2
    with pytest.raises(UsageError, match="ZeRO-Offload steps DeepSpeed's own CPU AdamW"):
        TrialConfig(engine="zero2", cpu_offload="optimizer", optimizer="adafactor")
    # an engine on one GPU (FSDP2 offload) still runs under torchrun, as a group of one
    one = TrialConfig(engine="fsdp2", cpu_offload="all")
    assert distributed.launched(one) and distributed.launch_command(one, "t.py").startswith(
        "OMP_NUM_THREADS=$(( $(nproc) / 1 )) torchrun")  # offload: the CPU step gets the cores, not torchrun's 1
    two = TrialConfig(engine="fsdp2", gpus=2)
    assert distributed.launch_command(two, "t.py") == "torchrun --standalone --nproc-per-node 2 t.py"
    assert (
        distributed.rank_threads(2) == max(1, len(os.sched_getaffinity(0)) // 2) and distributed.rank_threads(999) == 1
    )
    assert not distributed.launched(TrialConfig())
    ds = distributed.deepspeed_config(TrialConfig(engine="zero3", method="full", cpu_offload="all"))
    assert ds["optimizer"]["type"] == "AdamW" and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "optimizer" not in distributed.deepspeed_config(TrialConfig(engine="zero3", method="full"))
    space = Space("s", {"global_batch": 16}, {"micro_batch_size": [2, 4, 8], "gpus": [4]}, divisors_only=True)
    assert [c.micro_batch_size for c in space.candidates()] == [2, 4]  # 8 x 4 ranks would train 32


TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
autofit/probe FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_15:40:01
  host      : node
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_merge_takes_the_worst_rank_and_names_the_root_cause() -> None:
    cfg = CFG.to_dict()
    fit = ProbeResult(Outcome.FIT, cfg, tokens_per_s=100.0, peak_memory_bytes=5)
    crash = ProbeResult(Outcome.CRASH, cfg, reason="Connection closed by peer")
    oom = ProbeResult(Outcome.OOM, cfg, reason="CUDA out of memory")
    assert merge({0: crash, 1: oom}, 2, cfg, "").reason == "rank 1: CUDA out of memory"
    boom = ProbeResult(Outcome.CRASH, cfg, reason="RuntimeError: boom")
    assert merge({0: crash, 1: boom}, 2, cfg, "").reason == "rank 1: RuntimeError: boom"  # not the consequence
    nccl = ProbeResult(Outcome.CRASH, cfg, reason="ProcessGroupNCCL: Watchdog caught collective operation timeout")
    assert "a collective timed out (NCCL watchdog)" in merge({0: nccl, 1: fit}, 2, cfg, "").reason
    log = "[default3]:ValueError: bad shape\n[default0]:RuntimeError: Connection closed by peer\n" + TORCHRUN_SUMMARY
    label = merge({0: fit, 1: fit, 2: fit}, 4, cfg, log).reason
    assert label == "rank 3: ValueError: bad shape (signal 9)"  # rank 0's log line is not rank 3's
    lost = merge({}, 2, cfg, "torch.distributed.DistNetworkError: failed to bind")
    assert lost.outcome is Outcome.CRASH and "no result: torch.distributed.DistNetworkError" in lost.reason
    assert root_cause(TORCHRUN_SUMMARY).rank == 3 and root_cause(TORCHRUN_SUMMARY).exitcode == -9
    missing = merge({0: fit, 1: fit, 2: fit}, 4, cfg, TORCHRUN_SUMMARY)
    assert missing.outcome is Outcome.CRASH and missing.reason.startswith("rank 3: ") and "signal 9" in missing.reason
    both = merge({0: fit, 1: ProbeResult(Outcome.FIT, cfg, tokens_per_s=90.0, peak_memory_bytes=7)}, 2, cfg, "")
    assert both.tokens_per_s == 190.0 and both.peak_memory_bytes == 7
    assert json.dumps(both.to_dict())  # the stored form
    assert ranks_line(both) == "ranks        2: rank 0 fit 100 tokens/s 5 B; rank 1 fit 90 tokens/s 7 B"
