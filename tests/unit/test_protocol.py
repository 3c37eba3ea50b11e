"""The probe's logic in-process: the request, the outcome of real error texts, the limit and
headroom, the spread rule, the evidence for the OOM killer, the runner's cancellation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.cli import build_parser
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import HEADROOM
from autofit.probe.child.judge import failure_result, judge_limit
from autofit.probe.child.state import ProbeState
from autofit.probe.child.timing import spread, timing_done
from autofit.probe.runner import _outside_sigkill
from autofit.protocol.kills import KillWatch, oom_kill_count
from autofit.protocol.request import SPREAD_BOUND, ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult
from autofit.protocol.signatures import classify_text


def _request(**kw: object) -> ProbeRequest:
    cfg = TrialConfig.from_mapping({"max_length": 128, "global_batch": 4, "micro_batch_size": 2})
    return ProbeRequest(config=cfg, model=resolve_model("tiny-llama"), result_path="/x/r.json", **kw)


def test_request_round_trips_through_json() -> None:
    req = _request(device="cuda", nvml_index=3, memory_limit_bytes=40 * 2**30, headroom=0.1, timed_steps=7,
                   max_probe_accumulation=None)
    back = ProbeRequest.from_json(req.to_json())
    assert back == req
    assert back.config.key() == req.config.key() and back.model.ref == "tiny-llama"
    assert back.usable_bytes == int(40 * 2**30 * 0.9)


@pytest.mark.parametrize("command", ["probe", "search", "regress"])
def test_a_request_without_measuring_settings_measures_as_the_cli_s_defaults(command: str) -> None:
    """A request that leaves the measuring settings out (as JSON reaches the child) gets what a user who
    passes no flag gets from each command: the same headroom, warm-up, timed steps and accumulation cap."""
    argv = {"probe": ["probe", "--model", "tiny-llama"], "search": ["search", "--model", "tiny-llama"],
            "regress": ["regress", "runs/x"]}[command]
    args = build_parser().parse_args(argv)
    cfg = TrialConfig.from_mapping({"max_length": 128, "global_batch": 4, "micro_batch_size": 2})
    minimal = json.dumps({"config": cfg.to_dict(), "model": resolve_model("tiny-llama").to_dict(),
                          "result_path": "r.json"})
    req = ProbeRequest.from_json(minimal)
    wanted = {name: getattr(args, name) for name in ("headroom", "warmup_steps", "timed_steps",
                                                     "max_probe_accumulation") if hasattr(args, name)}
    assert wanted, argv  # each command takes some of them
    assert {name: getattr(req, name) for name in wanted} == wanted


@pytest.mark.parametrize("cap, ga, probed", [(4, 2, 2), (4, 16, 4), (None, 16, 16), (1, 3, 1)])
def test_probe_accumulation_is_capped(cap: int | None, ga: int, probed: int) -> None:
    cfg = TrialConfig.from_mapping({"max_length": 128, "global_batch": ga, "micro_batch_size": 1})
    req = ProbeRequest(config=cfg, model=resolve_model("tiny-llama"), result_path="r", max_probe_accumulation=cap)
    assert cfg.gradient_accumulation_steps == ga and req.probe_accumulation == probed


# Error texts as torch, the CUDA allocator, glibc and transformers print them.
@pytest.mark.parametrize("text, outcome", [
    (("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
     "capacity of 79.19 GiB of which 3.06 MiB is free."), Outcome.OOM),
    ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
     Outcome.OOM),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", Outcome.OOM),
    (("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes. "
     "Error code 12 (Cannot allocate memory)"), Outcome.HOST_OOM),
    (("ImportError: FlashAttention2 has been toggled on, but it cannot be used due to the following error: "
     "the package flash_attn seems to be not installed."), Outcome.UNSUPPORTED),
    ("ValueError: Your setup doesn't support bf16/gpu.", Outcome.UNSUPPORTED),
    ("AssertionError: Torch not compiled with CUDA enabled", Outcome.UNSUPPORTED),
    ("ValueError: Target modules {'no_such_module'} not found in the base model.", None),
])
def test_real_error_texts_are_classified(text: str, outcome: Outcome | None) -> None:
    assert classify_text(text) is outcome


def test_a_raised_error_keeps_its_outcome_and_the_load_figure() -> None:
    req = _request()
    try:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    except RuntimeError as e:
        res = failure_result(req, e, ProbeState(memory_after_load=123))
    assert res.outcome is Outcome.HOST_OOM and res.memory_after_load == 123
    assert "Traceback" in res.error_tail and res.config == req.config


@pytest.mark.parametrize("peak, outcome, reason", [
    (94, Outcome.FIT, ""),           # below the usable 95
    (95, Outcome.FIT, ""),           # exactly the usable memory
    (96, Outcome.OOM, "headroom"),   # inside the 5% headroom
    (100, Outcome.OOM, "headroom"),  # at the limit itself: still inside
    (101, Outcome.OOM, "limit"),     # above the limit
])
def test_judge_limit_headroom_and_limit(peak: int, outcome: Outcome, reason: str) -> None:
    res = judge_limit(ProbeResult(Outcome.FIT, {}, peak_memory_bytes=peak * 2**20), 100 * 2**20, HEADROOM)
    assert res.outcome is outcome
    assert res.reason.startswith(reason)
    assert res.headroom_bytes == 5 * 2**20
    if outcome is Outcome.OOM:
        assert res.oom_shortfall_bytes == (peak - 95) * 2**20


def test_judge_limit_leaves_other_outcomes_and_no_limit_alone() -> None:
    unstable = ProbeResult(Outcome.UNSTABLE, {}, peak_memory_bytes=200, reason="non-finite loss")
    assert judge_limit(unstable, 100, HEADROOM).outcome is Outcome.UNSTABLE
    fit = ProbeResult(Outcome.FIT, {}, peak_memory_bytes=10**12)
    assert judge_limit(fit, None, HEADROOM).outcome is Outcome.FIT


def test_spread_rule() -> None:
    even = [1.0, 1.02, 0.99, 1.01, 1.0]
    assert spread(even) < SPREAD_BOUND and timing_done(even, 5, 5)
    assert not timing_done(even[:4], 5, 5)  # fewer than the timed steps
    slow_start = [2.6, 1.0, 1.0, 1.01, 1.0]
    assert not timing_done(slow_start, 5, 5)  # 2.6x: time another step
    assert timing_done([*slow_start, 1.0], 5, 5)  # the last five are even again
    noisy = [1.0, 2.0] * 5
    assert not timing_done(noisy[:9], 5, 5) and timing_done(noisy, 5, 5)  # no step left to add
    assert spread(noisy[-5:]) == 2.0


def test_spread_is_serialised() -> None:
    res = ProbeResult(Outcome.FIT, {}, tokens_per_s=100, tokens_per_s_min=90, tokens_per_s_max=99, noisy=False)
    assert res.to_dict()["spread"] == 1.1 and ProbeResult.from_dict(res.to_dict()).spread == pytest.approx(1.1)


# -- who killed a child ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_oom_kill_count_from_the_cgroup_files(tmp_path: Path, layout: str) -> None:
    if layout == "v2":
        d = tmp_path / "user.slice" / "job"
        d.mkdir(parents=True)
        (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
        proc = "0::/user.slice/job\n"
    else:
        d = tmp_path / "memory" / "docker" / "abc"
        d.mkdir(parents=True)
        (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
        proc = "4:memory:/docker/abc\n1:cpu:/\n"
    assert oom_kill_count(tmp_path, proc) == (2 if layout == "v2" else 5)
    assert oom_kill_count(tmp_path / "nothing", proc) is None


def test_this_machine_s_cgroup_lines_lead_to_its_oom_kill_count(tmp_path: Path) -> None:
    """The real /proc/self/cgroup of whatever machine runs the suite (v1, v2 or both) resolves to the
    folder its memory cgroup has under the root: a count written there, and only there, is found."""
    proc = Path("/proc/self/cgroup").read_text()
    memory_line = next((line.split(":", 2) for line in proc.splitlines()
                        if line.split(":", 2)[1:2] in (["memory"], [""])), None)
    assert memory_line is not None, proc  # every Linux CI machine shows a v1 memory or a v2 unified line
    _, controllers, path = memory_line
    folder = tmp_path / ("memory" if controllers == "memory" else "") / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    events = "memory.oom_control" if controllers == "memory" else "memory.events"
    (folder / events).write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom_kill_count(tmp_path, proc) == 7
    (folder / events).write_text("oom_kill_disable 0\n")  # no count line: nothing to read
    assert oom_kill_count(tmp_path, proc) is None


def test_a_sigkill_without_evidence_is_a_retryable_crash() -> None:
    watch = KillWatch.start()
    watch.sample()
    assert watch.host_oom_evidence(2**22 + 7) is None  # plenty of memory, no OOM kill since the start
    res = _outside_sigkill({}, "", None)
    assert res.outcome is Outcome.CRASH and res.retryable
    assert res.reason.startswith("killed by SIGKILL from outside autofit")


def test_a_sigkill_with_evidence_is_host_oom() -> None:
    watch = KillWatch(oom_kills_at_start=-1)  # the count rose (from a count below any real one)
    evidence = watch.host_oom_evidence(1)
    if oom_kill_count() is None:
        watch.recent.append(0.01)  # no cgroup file here: memory nearly exhausted at its death
        evidence = watch.host_oom_evidence(1)
    assert evidence is not None
    res = _outside_sigkill({}, "", evidence)
    assert res.outcome is Outcome.HOST_OOM and not res.retryable and evidence in res.reason
