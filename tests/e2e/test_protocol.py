"""The probe's logic in-process: the request, the outcome of real error texts, the limit and
headroom, the spread rule, the evidence for the OOM killer, the runner's cancellation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import FAKE_CHILD

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.probe.runner import Runner
from autofit.probe.standby import HOLD
from autofit.protocol.request import ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult


def _request(**kw: object) -> ProbeRequest:
    cfg = TrialConfig.from_mapping({"max_length": 128, "global_batch": 4, "micro_batch_size": 2})
    return ProbeRequest(config=cfg, model=resolve_model("tiny-llama"), result_path="/x/r.json", **kw)


# -- the runner with a stand-in child ------------------------------------------------------------------


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setenv("AUTOFIT_PROBE_COMMAND", f"{sys.executable} {FAKE_CHILD}")


def test_a_cancelled_probe_is_cancelled(tmp_path: Path, fake: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "hang")
    with Runner(Target(), tmp_path, standby=0) as runner:
        t0 = time.monotonic()
        res = runner.run(_request().config, resolve_model("tiny-llama"), name="c", timeout=60,
                         cancel=lambda: time.monotonic() - t0 > 1)
    assert res.outcome is Outcome.CANCELLED
    assert time.monotonic() - t0 < 30


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_standby_imports_are_held_during_the_timed_phase(tmp_path: Path, fake: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MODE", "timed")
    monkeypatch.setenv("FAKE_TIMED_S", "3")
    stops = HOLD.stops
    with Runner(Target(), tmp_path, standby=1) as runner:
        runner.warm_up()
        first = runner._pool[0]
        first.ready.wait(30)
        monkeypatch.setenv("FAKE_IMPORT_S", "30")  # the next standby "imports" for 30 s
        out: list[ProbeResult] = []
        th = threading.Thread(target=lambda: out.append(
            runner.run(_request().config, resolve_model("tiny-llama"), name="t", timeout=60)))
        th.start()
        deadline = time.monotonic() + 20
        while not (runner._pool and first._timing) and time.monotonic() < deadline:
            time.sleep(0.05)
        importing = runner._pool[0]
        time.sleep(0.5)
        during = _state(importing.proc.pid)
        th.join(30)
        time.sleep(0.3)
        after = _state(importing.proc.pid)
    assert out and "timed phase over" in Path(out[0].log_path).read_text()
    assert during == "T"  # stopped while the other probe was timed
    assert after in ("S", "R")  # and continued once it was over
    assert HOLD.stops == stops + 1
