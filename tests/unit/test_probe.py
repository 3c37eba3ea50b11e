"""`autofit probe`: real training steps on tiny-llama in real child processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_a_noisy_reason_names_the_hosts_share_of_the_slowest_step() -> None:
    from autofit.probe.child.hostclock import slowest

    host = {"thread_cpu_s": [1.9, 2.0, 1.9], "process_cpu_s": [2.5, 2.6, 2.4], "run_wait_s": [0.01, 1.5, 0.0],
            "steal_cpu_s": [0.0, 0.4, 0.0]}
    note = slowest([2.0, 3.6, 1.95], host)
    assert "(ran 3.60 s) against the fastest (1.95 s)" in note
    assert "(ran 0.90 s) against the fastest (0.49 s)" in slowest(
        [2.0, 3.6, 1.95], {**host, "step_s": [0.5, 0.9, 0.49]}
    )
    assert "waiting for a CPU 1.50 vs 0.00 s" in note and "hypervisor (all CPUs) 0.40 vs 0.00 s" in note
    assert "all its threads on a CPU 2.60 vs 2.40 s" in note
    # ranked by work where steps differ in it: the 3.6 s step carried twice the work, the fastest per unit
    by_work = slowest([2.0, 3.6, 1.95], host, [2.0, 1.8, 1.95])
    assert "slowest step per unit of work (ran 2.00 s) against the fastest (3.60 s)" in by_work
    assert slowest([2.0], host) == "" and slowest([2.0, 3.0], {"thread_cpu_s": []}) == ""
    # with the GPU's figures: its SM clock in the slowest step against the fastest, and why it was held back
    gpu = {**host, "sm_clock_mhz": [1980, 1410, 1980], "clock_events": [["idle"], ["idle", "power cap"], ["idle"]]}
    assert "SM clock 1,410 vs 1,980 MHz, clock held back by power cap in the slowest" in slowest([2.0, 3.6, 1.95], gpu)


def test_the_device_clock_window_averages_its_samples_and_starts_again() -> None:
    from autofit.probe.child.sampler import _DeviceClock, clock_event_bit

    clock = _DeviceClock()
    assert clock_event_bit("power cap") and clock_event_bit("power cap") != clock_event_bit("idle")
    clock.add(1980, 650.0, 0)
    clock.add(1410, 700.0, clock_event_bit("power cap"))
    clock.add(None, None, None)  # a reading the driver refused counts for nothing
    assert clock.window() == {"sm_clock_mhz": 1695, "power_w": 675.0, "clock_events": ["power cap"]}
    assert clock.window() == {"sm_clock_mhz": None, "power_w": None, "clock_events": []}


def test_fixed_cores_take_one_thread_per_physical_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autofit.probe.child.quiet import CORES_ENV, fixed_cores, one_thread_per_core

    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():  # two cores, two threads each
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert one_thread_per_core({0, 1, 2, 3, 5}, tmp_path) == [0, 1, 5]  # cpu5's topology unread: its own core
    assert one_thread_per_core({2, 3}, tmp_path) == [2, 3]
    # this machine's own topology
    allowed = os.sched_getaffinity(0)
    cores = one_thread_per_core(allowed)
    lists = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text() for c in cores}
    assert cores and set(cores) <= allowed and len(lists) == len(cores)
    monkeypatch.delenv(CORES_ENV, raising=False)
    assert fixed_cores(allowed, 0) == allowed  # unset: the GPU's local cores, unchanged
    monkeypatch.setenv(CORES_ENV, "1")
    assert fixed_cores(allowed, 0) == {cores[0]}
    assert fixed_cores(allowed, 1) == {cores[1 % len(cores)]}  # the next GPU, the next core
    monkeypatch.setenv(CORES_ENV, str(len(cores) + 4))
    assert fixed_cores(allowed, 0) == set(cores)
    monkeypatch.setenv(CORES_ENV, "0")
    with pytest.raises(ValueError, match=CORES_ENV):
        fixed_cores(allowed, 0)


# ----------------------------------------------------------------------------- the keys


def test_every_optimizer_name_is_a_transformers_optim() -> None:
    from transformers.training_args import OptimizerNames

    from autofit.config.spec import OPTIMIZERS

    names = {o.value for o in OptimizerNames}
    assert set(OPTIMIZERS) <= names, set(OPTIMIZERS) - names


ALLOCATOR_CHILD = """
import os, sys, torch
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.probe.child import allocator
from autofit.protocol.request import ProbeRequest

req = ProbeRequest(TrialConfig(expandable_segments=True), resolve_model("tiny-llama"), "r.json")
allocator.settings_now()  # the allocator reads its variables now, as a CUDA build's does before a request comes
os.environ.update({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})  # after that read: too late
print(repr(allocator.settings_now()))
try:
    allocator.verify(req)
except RuntimeError as e:
    print(e)
allocator.apply(req)
print(allocator.verify(req))
"""


def test_the_allocator_check_fails_where_only_the_environment_was_set() -> None:
    """What the probe did before: the variable set after the allocator had read its settings (a CUDA build reads
    them before the request comes); the allocator never saw it, and the check says so. Then the setting given
    to torch itself holds, over what the process inherited."""
    import subprocess
    import sys

    from autofit.probe.child.allocator import expandable_in, settings_for

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parents[2]), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", ALLOCATOR_CHILD], capture_output=True, text=True, env=env,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0] == "'max_split_size_mb:64'"  # what the allocator read first: the variable set later is not in it
    assert out[1].startswith("autofit: the allocator ran with expandable_segments=False, but the config asks for True")
    assert out[2] == ("{'allocator_settings': 'max_split_size_mb:64,expandable_segments:True', "
                      "'expandable_segments_ran': True}")
    # the last key holds, as the allocator reads them
    assert settings_for(False, " expandable_segments:True,") == "expandable_segments:True,expandable_segments:False"
    assert expandable_in("expandable_segments:True,expandable_segments:False") is False
    assert expandable_in("roundup_power2_divisions:[256:1,512:2], expandable_segments:True") is True
    assert expandable_in("") is False
