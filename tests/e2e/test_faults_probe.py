"""Faults on the probe side, each a real process and a real signal: an outside kill -9 of a
probe child, and kill -9 of the process that runs the probes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import ROOT, fake_env
from faults import Fault

FAULTS = [
    Fault("search-killed", "kill -9 of the process running probes (a search, while a probe and two standby "
          "processes run)", "kill -9 <autofit search>", None,
          "every child ends within 5 s; logs/ holds no stray standby file", nothing_lost=True),
    Fault("probe-killed-outside", "kill -9 of a probe child from outside autofit, with memory to spare",
          "kill -9 <probe child>", 0, "killed by SIGKILL from outside autofit"),
    Fault("lora-target-misspelt", "a misspelt LoRA target beside a right one (peft would drop it silently)",
          "autofit probe --model tiny-llama --set lora_targets=q_proj,zzz_proj", 2,
          "--set lora_targets: tiny-llama (llama) has no module zzz_proj for lora_targets to adapt"),
]

PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autofit.config.models import resolve_model
    from autofit.probe.runner import Runner
    from autofit.config.spec import TrialConfig
    from autofit.config.target import Target

    logs = Path(sys.argv[1])
    with Runner(Target(), logs, standby=2) as runner:
        runner.warm_up()
        for s in runner._pool:
            s.ready.wait(30)
        pids = [s.proc.pid for s in runner._pool]
        (logs / "standby.pids").write_text(" ".join(map(str, pids)))
        runner.run(TrialConfig(), resolve_model("tiny-llama"), name="trial-0000", timeout=600)
""")


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), path


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie not yet reaped by init: gone
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_kill_9_of_the_parent_ends_its_children_and_leaves_no_stray_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    env = dict(os.environ, **fake_env("hang"), PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(logs)], env=env, cwd=tmp_path)
    _wait_for(logs / "fake-child.pid")  # a probe is running, two standby processes wait
    probe_pid = int((logs / "fake-child.pid").read_text())
    standby_pids = [int(x) for x in (logs / "standby.pids").read_text().split()]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for pid in [probe_pid, *standby_pids]:
        assert _gone(pid, 5), f"child {pid} outlived its parent"
    left = sorted(p.name for p in logs.iterdir())
    assert left == ["fake-child.pid", "standby.pids", "trial-0000.log"], left  # no hidden standby logs


def test_an_outside_kill_9_of_a_probe_is_a_retryable_crash(tmp_path: Path) -> None:
    env = dict(os.environ, **fake_env("hang"), PYTHONPATH=str(ROOT))
    cli = subprocess.Popen([sys.executable, "-m", "autofit", "probe", "--model", "tiny-llama", "--device", "cpu",
                            "--json", "--log-dir", str(tmp_path)], env=env, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "fake-child.pid")
    os.kill(int((tmp_path / "fake-child.pid").read_text()), signal.SIGKILL)  # not the OOM killer
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    r = json.loads(out)
    assert r["outcome"] == "crash" and r["retryable"] is True
    assert r["reason"].startswith(FAULTS[1].message)


def test_a_misspelt_lora_target_is_refused_before_the_probe(tmp_path: Path) -> None:
    """It was a probe that crashed (exit 0, a traceback in the log): the names are checked before any child."""
    fault = next(f for f in FAULTS if f.id == "lora-target-misspelt")
    proc = subprocess.run([sys.executable, "-m", "autofit", "probe", "--model", "tiny-llama", "--device", "cpu",
                           "--set", "lora_targets=q_proj,zzz_proj", "--set", "max_length=64", "--json",
                           "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == fault.exit_code, proc.stderr
    assert proc.stderr.startswith(f"autofit: error: {fault.message}") and "Traceback" not in proc.stderr
    assert "q_proj, up_proj, v_proj" in proc.stderr  # the names it could have meant
    assert not list(tmp_path.glob("*.log"))  # no probe ran
