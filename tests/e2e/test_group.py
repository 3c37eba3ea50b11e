"""Probes spanning several ranks: real torchrun, real FSDP2 over gloo on the CPU, and ranks that fail.

A faulty rank is tests/fake_rank.py (started by the real torchrun in place of one rank): it raises,
prints the real CUDA out-of-memory text, or hangs; the other rank is the real probe.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import probe_json, run_cli

from autofit.config import distributed
from autofit.config.models import resolve_model
from autofit.config.space import Space
from autofit.config.spec import TrialConfig
from autofit.config.target import Target, resolve_targets
from autofit.core.errors import UsageError
from autofit.probe.child.ranks import RANK_ENV
from autofit.probe.runner import Runner
from autofit.protocol.group import merge, root_cause
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.lines import ranks_line

FAKE_RANK = Path(__file__).resolve().parent / "fake_rank.py"
SMALL = ["--set", "max_length=64", "--set", "global_batch=8", "--set", "micro_batch_size=2",
         "--set", "precision=fp32"]
CFG = TrialConfig(max_length=64, global_batch=8, micro_batch_size=2, precision="fp32", gpus=2)


def test_a_two_rank_fsdp2_probe_on_the_cpu_shards_and_reports_the_group(tmp_path: Path) -> None:
    """Real torchrun, two gloo ranks, Trainer with fsdp_config (FSDP2) and FSDP's own activation
    checkpointing: accelerate really sharded (FSDP modules), every layer recomputes, the group's
    tokens/s is the ranks' sum and its peak the largest rank's."""
    res = probe_json("--gpus", "2", "--set", "engine=fsdp2", "--set", "gradient_checkpointing=on", *SMALL,
                     "--log-dir", str(tmp_path))
    assert res["outcome"] == "fit", res["reason"] + res["error_tail"]
    extra = res["extra"]
    assert extra["distributed_type"] == "FSDP" and extra["wrapped_class"].startswith("FSDP")
    assert extra["fsdp_modules"] >= res["n_layers"] + 1  # every decoder layer and the root
    assert res["checkpointed_layers"] == list(range(res["n_layers"]))
    ranks = extra["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and extra["world_size"] == 2
    assert res["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in ranks))
    assert res["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in ranks)
    assert res["config"]["gpus"] == 2 and res["config"]["gradient_accumulation_steps"] == 2
    assert not list(tmp_path.glob("*.rank*.result.json")) and not list(tmp_path.glob("*.request.json"))
    (merged,) = tmp_path.glob("*.result.json")  # where a resumed search finds a finished probe
    assert json.loads(merged.read_text())["tokens_per_s"] == res["tokens_per_s"]


def _fake_rank(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """torchrun starts tests/fake_rank.py for every rank: rank 1 does `mode`, the others are real."""
    monkeypatch.setenv(RANK_ENV, str(FAKE_RANK))
    monkeypatch.setenv("FAKE_RANK_MODE", mode)


def _group_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
                 timeout: float = 300) -> tuple[ProbeResult, float]:
    _fake_rank(monkeypatch, mode)
    with Runner(Target(), tmp_path, standby=0) as runner:
        t0 = time.monotonic()
        res = runner.run(CFG, resolve_model("tiny-llama"), name="g", timeout=timeout)
        return res, time.monotonic() - t0


@pytest.mark.parametrize("mode, outcome, says", [
    ("raise", Outcome.CRASH, "RuntimeError: autofit test: this rank failed on purpose"),
    ("oom", Outcome.OOM, "CUDA out of memory"),
])
def test_a_failing_rank_decides_the_groups_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
                                                  outcome: Outcome, says: str) -> None:
    """torchrun stops the real rank 0 when rank 1 fails; the group is judged by the rank that failed."""
    res, took = _group_probe(tmp_path, monkeypatch, mode)
    assert res.outcome is outcome, res.reason + res.error_tail
    assert res.reason.startswith("rank 1: ") and says in res.reason
    assert {r["rank"]: r["outcome"] for r in res.extra["ranks"]}[1] == outcome.value
    if outcome is Outcome.OOM:
        assert res.oom_request_bytes == 2 * 2**30  # "Tried to allocate 2.00 GiB"
    assert took < 120  # not left waiting for the runner's timeout


def test_a_hanging_rank_times_out_and_the_whole_group_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 ) -> None:
    """Rank 1 never joins: the real rank 0 waits for it; at the timeout every process of the group
    (the launcher, torchrun's ranks in sessions of their own) is killed, none is left behind."""
    res, took = _group_probe(tmp_path, monkeypatch, "hang", timeout=15)
    assert res.outcome is Outcome.TIMEOUT and "every rank of the group was stopped" in res.reason
    assert 15 <= took < 45
    pid = int(next(tmp_path.glob("*.fake-rank-1.pid")).read_text())
    time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    left = [p for p in psutil.process_iter(["cmdline"]) if any(str(tmp_path) in a for a in p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


def test_a_group_dies_with_a_search_killed_by_sigkill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kill -9` of the process running the probes (a search) in the middle of a group: the launcher
    and every rank die with it (parent-death signals down the chain), nothing is left running."""
    import signal
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\nfrom pathlib import Path\nfrom autofit.config.models import resolve_model\n"
        "from autofit.probe.runner import Runner\nfrom autofit.config.spec import TrialConfig\nfrom autofit.config.target import Target\n"
        f"cfg = TrialConfig.from_dict({CFG.to_dict()!r})\n"
        "with Runner(Target(), Path(sys.argv[1]), standby=0) as r:\n"
        "    r.run(cfg, resolve_model('tiny-llama'), name='g', timeout=600)\n")
    _fake_rank(monkeypatch, "hang")
    proc = subprocess.Popen([sys.executable, str(driver), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*.fake-rank-1.pid")) and time.monotonic() < deadline:
            time.sleep(0.2)
        group = [p for p in psutil.process_iter(["cmdline"]) if any(str(tmp_path) in a for a in p.info["cmdline"] or [])
                 and p.pid != proc.pid]
        assert len(group) >= 3, [p.info["cmdline"] for p in group]  # the launcher, rank 0, rank 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        _, alive = psutil.wait_procs(group, timeout=15)
        assert not alive, [p.cmdline() for p in alive if p.is_running()]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_interrupted_group_says_nothing_about_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (the runner's abort) in the middle of a group: a retryable result, and no result file a
    resumed search would adopt as this config's outcome."""
    import threading

    _fake_rank(monkeypatch, "hang")
    with Runner(Target(), tmp_path, standby=0) as runner:
        threading.Timer(4.0, runner.abort).start()
        res = runner.run(CFG, resolve_model("tiny-llama"), name="g", timeout=120)
    assert res.retryable and res.reason.startswith("interrupted")
    assert not list(tmp_path.glob("*.result.json"))


# ----------------------------------------------------------------------------- judged without a launch


def test_a_search_whose_configs_all_need_more_gpus_says_so_and_what_to_do(tmp_path: Path) -> None:
    """Not "nothing fits" with advice about memory: nothing was probed, and --gpus is the answer (3 configs:
    4 GPUs at micro-batch 2 would step on 8 sequences, more than the global batch of 4)."""
    space = tmp_path / "space.yaml"
    space.write_text("method: lora\nfixed: {max_length: 64, global_batch: 4, precision: fp32}\n"
                     "dimensions:\n  gpus: [2, 4]\n  micro_batch_size: [1, 2]\n")
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--space", str(space), "--budget", "30s",
                   "--out", str(tmp_path / "runs"))
    assert proc.returncode == 3, proc.stderr
    assert ("Nothing was probed: nothing left to probe here: 3 untried configuration(s) need more GPUs than a "
            "worker has (1); run with --gpus 2") in proc.stderr
    assert "memory-limit" not in proc.stderr and "Traceback" not in proc.stderr


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
    assert distributed.rank_threads(2) == max(1, len(os.sched_getaffinity(0)) // 2) and distributed.rank_threads(999) == 1
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


def test_the_probe_help_says_how_gpus_and_gpu_differ() -> None:
    import subprocess

    out = " ".join(subprocess.run([sys.executable, "-m", "autofit", "probe", "--help"], capture_output=True,
                                  text=True, check=True).stdout.split())
    assert "--gpus N" in out and "two single-GPU workers side by side" in out
