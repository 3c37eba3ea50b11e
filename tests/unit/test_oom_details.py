"""What an out-of-memory probe tells: torch's CUDA OOM text parsed, the phase it struck in, what it
proves about the config's peak, and the line a person reads."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.probe.child.errors import MemoryLimitExceeded
from autofit.probe.child.judge import failure_result
from autofit.probe.child.sampler import Memory
from autofit.probe.child.state import ProbeState
from autofit.probe.child.timing import ProbeCallback, TimingPlan
from autofit.protocol.request import ProbeRequest
from autofit.protocol.result import OOM_PHASES, Outcome, ProbeResult
from autofit.protocol.signatures import OomFigures, oom_figures
from autofit.run.report.lines import oom_brief, probe_summary

GiB, MiB = 2**30, 2**20

# torch 2.x's message (c10/cuda/CUDACachingAllocator.cpp), as an H200 printed it.
H200 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 22.70 GiB memory "
        "in use. Of the allocated memory 21.05 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
# Under torch.cuda.set_per_process_memory_fraction the allocator adds "<cap> allowed; " before
# "Of the allocated memory" (the probe's --memory-limit on a GPU sets that cap).
CAPPED = H200.replace("139.80 GiB of which 1.02 GiB", "139.80 GiB of which 115.31 GiB").replace(
    "memory in use. Of", "memory in use. 23.40 GiB allowed; Of")
# Without NVML in the container the process line is empty; sizes under 1 KiB print as "bytes".
NO_NVML = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
           "of 47.38 GiB of which 8.69 MiB is free. Of the allocated memory 46.80 GiB is allocated by PyTorch, "
           "and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
           "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
# Another process on the same GPU is listed first, by its pid.
SHARED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 554.00 MiB. GPU 0 has a total capacity "
          "of 39.49 GiB of which 182.56 MiB is free. Process 414660 has 13.09 GiB memory in use. Including "
          "non-PyTorch memory, this process has 26.12 GiB memory in use. Of the allocated memory 25.33 GiB is "
          "allocated by PyTorch, and 499.39 MiB is reserved by PyTorch but unallocated.")


def _size(x: float, unit: int) -> int:
    return int(x * unit)


def test_the_full_message_gives_every_figure() -> None:
    f = oom_figures("Traceback (most recent call last):\n  ...\n" + H200)
    assert f == OomFigures(request=2 * GiB, free=_size(1.02, GiB), in_use=_size(22.70, GiB), allowed=None,
                           allocated=_size(21.05, GiB), reserved_unallocated=_size(1.10, GiB))
    assert f.shortfall == 2 * GiB - _size(1.02, GiB)
    assert f.in_use_with(outside=5 * GiB) == f.in_use  # NVML's figure wins


def test_under_a_per_process_cap_the_room_is_what_was_left_of_the_cap() -> None:
    f = oom_figures(CAPPED)
    assert f.allowed == _size(23.40, GiB) and f.free == _size(115.31, GiB)
    assert f.reserved == _size(21.05, GiB) + _size(1.10, GiB)
    # the device had 115 GiB free, but the cap left 23.40 - 22.15 = 1.25 GiB of the 2 GiB asked for
    assert f.shortfall == 2 * GiB - (_size(23.40, GiB) - f.reserved)
    assert 0.74 * GiB < f.shortfall < 0.76 * GiB


def test_without_nvml_in_use_is_the_allocator_s_reserved_plus_outside() -> None:
    f = oom_figures(NO_NVML)
    assert (f.request, f.free, f.in_use) == (20 * MiB, _size(8.69, MiB), None)
    assert f.reserved_unallocated == 0 and f.allocated == _size(46.80, GiB)
    assert f.in_use_with(outside=600 * MiB) == _size(46.80, GiB) + 600 * MiB
    assert f.in_use_with() == _size(46.80, GiB)


def test_another_process_s_line_is_not_this_process_s() -> None:
    f = oom_figures(SHARED)
    assert f.in_use == _size(26.12, GiB)
    assert f.request == 554 * MiB and f.reserved_unallocated == _size(499.39, MiB)


def test_the_last_message_of_a_log_counts() -> None:
    log = NO_NVML + "\nretrying with a smaller batch\n" + H200
    assert oom_figures(log).request == 2 * GiB and oom_figures(log).in_use == _size(22.70, GiB)


@pytest.mark.parametrize("text, asked, shortfall", [
    ("RuntimeError: CUDA error: out of memory", None, None),
    ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", None, None),
    # torch 1.x's wording: no "of which ... is free", so the request is the bound
    (("RuntimeError: CUDA out of memory. Tried to allocate 3.81 GiB (GPU 0; 14.58 GiB total capacity; "
      "5.28 GiB already allocated; 3.63 GiB free; 10.58 GiB reserved in total by PyTorch)"),
     _size(3.81, GiB), _size(3.81, GiB)),
])
def test_missing_parts_are_none(text: str, asked: int | None, shortfall: int | None) -> None:
    f = oom_figures(text)
    assert f.request == asked and f.shortfall == shortfall
    assert f.in_use is None and f.allocated is None and f.reserved_unallocated is None and f.allowed is None
    assert f.in_use_with(outside=GiB) is None


def test_oom_fields_round_trip_and_old_json_loads() -> None:
    res = ProbeResult(Outcome.OOM, {"micro_batch_size": 4}, oom_phase="backward", oom_request_bytes=2 * GiB,
                      oom_in_use_bytes=22 * GiB, oom_reserved_unallocated_bytes=GiB, oom_shortfall_bytes=GiB)
    back = ProbeResult.from_dict(res.to_dict())
    assert back == res and back.oom_phase == "backward" and back.oom_in_use_bytes == 22 * GiB
    old = {k: v for k, v in res.to_dict().items() if not k.startswith("oom_") or k == "oom_shortfall_bytes"}
    loaded = ProbeResult.from_dict(old)
    assert (loaded.oom_phase, loaded.oom_request_bytes, loaded.oom_in_use_bytes,
            loaded.oom_reserved_unallocated_bytes) == (None, None, None, None)
    assert loaded.oom_shortfall_bytes == GiB


@pytest.mark.parametrize("kw, bound", [
    ({"oom_in_use_bytes": 22 * GiB, "oom_request_bytes": 2 * GiB, "oom_shortfall_bytes": GiB}, 24 * GiB),
    # a probe that ran every step and was judged on its measured peak (headroom)
    ({"tokens_per_s": 900.0, "peak_memory_bytes": 23 * GiB, "oom_shortfall_bytes": GiB // 2,
      "memory_limit_bytes": 24 * GiB, "headroom_bytes": GiB}, 23 * GiB),
    # the CPU limit: the sampled memory in use
    ({"oom_in_use_bytes": 3 * GiB, "oom_shortfall_bytes": GiB, "memory_limit_bytes": 2 * GiB}, 3 * GiB),
    # only the shortfall and the limit: usable + shortfall
    ({"oom_shortfall_bytes": GiB, "memory_limit_bytes": 24 * GiB, "headroom_bytes": GiB}, 24 * GiB),
    ({"oom_shortfall_bytes": GiB}, None),
    ({}, None),
])
def test_peak_lower_bound(kw: dict[str, object], bound: int | None) -> None:
    assert ProbeResult(Outcome.OOM, {}, **kw).peak_lower_bound() == bound  # type: ignore[arg-type]


def test_no_bound_from_other_outcomes() -> None:
    fit = ProbeResult(Outcome.FIT, {}, tokens_per_s=1.0, peak_memory_bytes=GiB, oom_in_use_bytes=GiB,
                      oom_request_bytes=GiB)
    assert fit.peak_lower_bound() is None


def test_a_person_reads_the_oom_facts() -> None:
    res = ProbeResult(Outcome.OOM, {"micro_batch_size": 4}, oom_phase="backward", oom_request_bytes=2 * GiB,
                      oom_in_use_bytes=_size(22.7, GiB), oom_reserved_unallocated_bytes=_size(1.1, GiB),
                      oom_shortfall_bytes=_size(1.3, GiB), reason="CUDA out of memory")
    line = ("out of memory in backward: asked 2 GiB with 22.7 GiB in use; 1.1 GiB reserved but unallocated; "
            "short by >= 1.3 GiB")
    assert oom_brief(res) == line
    assert f"oom          {line}" in probe_summary(res)
    assert oom_brief(ProbeResult(Outcome.OOM, {}, oom_phase="load")) == "out of memory in load"
    assert oom_brief(ProbeResult(Outcome.OOM, {})) == ""


def _callback(limit: int | None) -> ProbeCallback:
    mem = Memory("cpu", None, limit)
    mem.rebase()
    return ProbeCallback(mem, lambda: None, TimingPlan(1, 1, 0, 0, lambda event: None))


def test_the_callback_knows_the_phase_trainer_is_in() -> None:
    cb, args = _callback(None), SimpleNamespace(gradient_accumulation_steps=2)
    seen = [cb.phase]
    cb.on_step_begin(args, None, None)
    seen.append(cb.phase)
    for event in (lambda: cb.forward_hook(None, (), None), lambda: cb.on_substep_end(),
                  lambda: cb.forward_hook(None, (), None), lambda: cb.on_pre_optimizer_step(),
                  lambda: cb.on_optimizer_step()):
        event()
        seen.append(cb.phase)
    assert seen == ["setup", "forward", "backward", "forward", "backward", "optimizer", "optimizer"]
    # the load and the checks come before the callback exists
    assert set(seen) | {ProbeState().phase, ProbeState(stage="check").phase} == set(OOM_PHASES)
    assert ProbeState().phase == "load" and ProbeState(callback=cb).phase == "optimizer"


def test_a_cpu_limit_crossed_in_backward_is_reported_there() -> None:
    cb = _callback(limit=32 * MiB)
    state = ProbeState(mem=cb.mem, callback=cb)
    cb.mem.start()
    cb.on_step_begin(SimpleNamespace(), None, None)
    cb.forward_hook(None, (), None)  # within the limit so far
    held = bytearray(128 * MiB)  # the backward's memory, really resident
    held[::4096] = b"x" * len(held[::4096])
    deadline = time.monotonic() + 10
    while not cb.mem.over_limit and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(MemoryLimitExceeded) as caught:
        cb.on_pre_optimizer_step()
    cfg = TrialConfig.from_mapping({"max_length": 128, "global_batch": 4, "micro_batch_size": 2})
    req = ProbeRequest(config=cfg, model=resolve_model("tiny-llama"), result_path="r", memory_limit_bytes=32 * MiB)
    res = failure_result(req, caught.value, state)
    del held
    assert res.outcome is Outcome.OOM and res.oom_phase == "backward"
    assert res.oom_in_use_bytes == res.peak_memory_bytes and res.oom_in_use_bytes > 32 * MiB
    assert res.oom_shortfall_bytes == res.oom_in_use_bytes - 32 * MiB
    assert res.peak_lower_bound() == res.oom_in_use_bytes


def test_an_unsupported_probe_reads_as_its_reason_alone() -> None:
    """An expected outcome showed autofit's own traceback frames and the reason twice, prefixed twice."""
    why = "fp16 mixed precision needs a GPU (Trainer refuses it on the CPU)"
    tail = ('  File "autofit/probe/measure.py", line 104, in prepare_device\n'
            f"autofit.probe.child.errors.Unsupported: autofit: unsupported: {why}\n")
    text = probe_summary(ProbeResult(Outcome.UNSUPPORTED, {}, reason=f"autofit: unsupported: {why}",
                                     error_tail=tail))
    assert f"outcome      unsupported  ({why})" in text and "error tail" not in text and "measure.py" not in text
    crash = probe_summary(ProbeResult(Outcome.CRASH, {}, reason="boom", error_tail="Traceback\nValueError: boom"))
    assert "error tail" in crash  # a crash keeps its tail
