"""Probes spanning several ranks: real torchrun, real FSDP2 over gloo on the CPU, and ranks that fail.

A faulty rank is tests/fake_rank.py (started by the real torchrun in place of one rank): it raises,
prints the real CUDA out-of-memory text, or hangs; the other rank is the real probe.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SUPPORT, probe_json, run_cli

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.probe.child.ranks import RANK_ENV
from autofit.probe.runner import Runner
from autofit.protocol.result import Outcome, ProbeResult

FAKE_RANK = SUPPORT / "fake_rank.py"
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
        "from autofit.probe.runner import Runner\nfrom autofit.config.spec import TrialConfig\n"
        "from autofit.config.target import Target\n"
        f"cfg = TrialConfig.from_dict({CFG.to_dict()!r})\n"
        "with Runner(Target(), Path(sys.argv[1]), standby=0) as r:\n"
        "    r.run(cfg, resolve_model('tiny-llama'), name='g', timeout=600)\n"
    )
    _fake_rank(monkeypatch, "hang")
    proc = subprocess.Popen([sys.executable, str(driver), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*.fake-rank-1.pid")) and time.monotonic() < deadline:
            time.sleep(0.2)
        group = [
            p
            for p in psutil.process_iter(["cmdline"])
            if any(str(tmp_path) in a for a in p.info["cmdline"] or []) and p.pid != proc.pid
        ]
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
    space.write_text(
        "method: lora\nfixed: {max_length: 64, global_batch: 4, precision: fp32}\n"
        "dimensions:\n  gpus: [2, 4]\n  micro_batch_size: [1, 2]\n"
    )
    proc = run_cli(
        "search",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--space",
        str(space),
        "--budget",
        "30s",
        "--out",
        str(tmp_path / "runs"),
    )
    assert proc.returncode == 3, proc.stderr
    assert (
        "Nothing was probed: nothing left to probe here: 3 untried configuration(s) need more GPUs than a "
        "worker has (1); run with --gpus 2"
    ) in proc.stderr
    assert "memory-limit" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_probe_help_says_how_gpus_and_gpu_differ() -> None:
    import subprocess

    out = " ".join(
        subprocess.run(
            [sys.executable, "-m", "autofit", "probe", "--help"], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert "--gpus N" in out and "two single-GPU workers side by side" in out
