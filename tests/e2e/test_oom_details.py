"""What an out-of-memory probe tells: torch's CUDA OOM text parsed, the phase it struck in, what it
proves about the config's peak, and the line a person reads."""

from __future__ import annotations

from pathlib import Path

from conftest import fake_env, probe_json

from autofit.protocol.result import ProbeResult
from autofit.run.report.lines import oom_brief

GiB, MiB = 2**30, 2**20


def _size(x: float, unit: int) -> int:
    return int(x * unit)


def test_a_capped_child_s_oom_fills_the_parent_s_result(tmp_path: Path) -> None:
    """A child that died printing torch's message under a cap: the runner reads the figures."""
    r = probe_json("--set", "max_length=128", env=fake_env("cuda_oom_capped"), cwd=tmp_path)
    assert r["outcome"] == "oom" and "CUDA out of memory" in r["reason"]
    assert r["oom_request_bytes"] == 2 * GiB
    assert r["oom_in_use_bytes"] == _size(22.70, GiB)
    assert r["oom_reserved_unallocated_bytes"] == _size(1.10, GiB)
    # 115 GiB free on the device, but 23.40 - (21.05 + 1.10) = 1.25 GiB left of the cap
    assert r["oom_shortfall_bytes"] == 2 * GiB - (_size(23.40, GiB) - _size(21.05, GiB) - _size(1.10, GiB))
    res = ProbeResult.from_dict(r)
    assert res.peak_lower_bound() == _size(22.70, GiB) + 2 * GiB
    assert oom_brief(res) == ("out of memory: asked 2 GiB with 22.7 GiB in use; 1.1 GiB reserved but "
                              "unallocated; short by >= 768 MiB")
