"""The fault suite, signals: what a job runner, a closed terminal or a plain kill sends a command (SIGHUP,
SIGTERM, SIGQUIT, SIGKILL, SIGPIPE), met by real `autofit` processes. A search's first probe hangs (the
probe child is tests/fake_child.py), so every signal lands before a probe has ended: the folder is left
consistent, `autofit report` says the search did not finish, and the resume command is printed where the
process could print it."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, cpu_search, fake_env
from faults import Fault

FAULTS = [
    Fault(
        "search-hup-first-probe",
        "SIGHUP (the terminal closed) while the first probe runs, in a run folder whose "
        "name is not UTF-8 (exit 129 without a word; report said 'Nothing fits')",
        "autofit search ... (SIGHUP); autofit report RUN",
        130,
        "Continue with: autofit search --resume $'",
        nothing_lost=True,
    ),
    Fault(
        "search-quit-first-probe",
        "SIGQUIT while the first probe runs (a core dump, a trial left running)",
        "autofit search ... (SIGQUIT)",
        130,
        "Continue with: autofit search --resume",
        nothing_lost=True,
    ),
    Fault(
        "search-kill-9-first-probe",
        "kill -9 of a search before its first probe ended, then `autofit report` (said 'Nothing fits')",
        "kill -9 <autofit search>; autofit report RUN",
        0,
        "not finished: the study records no end",
        nothing_lost=True,
    ),
    Fault(
        "search-hup-after-its-end",
        "SIGHUP just after a search has said its result, while the interpreter "
        "shuts down (killed by the signal: exit 129 replaced the search's own code)",
        "autofit search --memory-limit 1MiB (SIGHUP after its last line)",
        3,
        "Nothing was probed",
    ),
    Fault(
        "search-nohup-terminal-closed",
        "a search under `nohup` whose terminal closed (every write fails with EIO: "
        "a traceback, exit 1, the search stopped)",
        "nohup autofit search ... (terminal closed)",
        3,
        "## Nothing fits",
        nothing_lost=True,
    ),
    Fault(
        "probe-hup",
        "SIGHUP while `autofit probe` measures (exit 129, its child left to the parent-death signal)",
        "autofit probe ... (SIGHUP)",
        130,
        "autofit: interrupted; child processes stopped",
    ),
    Fault(
        "probe-sigpipe",
        "SIGPIPE sent by a job runner while `autofit probe` measures: ignored, as Python sets it "
        "(a command that restored its default would die there), then SIGTERM",
        "autofit probe ... (SIGPIPE, then SIGTERM)",
        130,
        "autofit: interrupted; child processes stopped",
    ),
    Fault(
        "data-hup-starting",
        "SIGHUP while `autofit data` starts (exit 129 without a word)",
        "autofit data train.jsonl --model tiny-llama (SIGHUP)",
        130,
        "autofit: interrupted",
    ),
]

STOPS = (signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGINT)


def _default_signals() -> None:
    """The child starts with the signals' default actions, as from a terminal or a job runner (a test run in
    the background inherits SIGINT and SIGQUIT ignored, which autofit would keep ignored)."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_DFL)


def _start(*args: str, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **fake_env("hang"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "autofit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        preexec_fn=_default_signals,
    )


def _wait_for(pattern: str, where: Path, seconds: float = 120) -> Path:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = next(where.glob(pattern), None)
        if found is not None and found.read_text().strip():
            return found
        time.sleep(0.1)
    raise AssertionError(f"nothing matched {pattern} in {where}")


def _wait_for_handler(pid: int, sig: int, seconds: float = 60) -> None:
    """Until process `pid` catches `sig` (its SigCgt mask in /proc): a signal sent sooner meets the default action,
    whatever the code does later, and how soon a loaded machine gets there is no test's business."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never set a handler for signal {sig}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


SEARCH_SIGNALS = {
    "search-hup-first-probe": signal.SIGHUP,
    "search-quit-first-probe": signal.SIGQUIT,
    "search-kill-9-first-probe": signal.SIGKILL,
}


@pytest.mark.parametrize("fault_id", list(SEARCH_SIGNALS))
def test_a_search_stopped_before_its_first_probe_ended_says_it_did_not_finish(tmp_path: Path, fault_id: str) -> None:
    fault = next(f for f in FAULTS if f.id == fault_id)
    out = tmp_path / (os.fsdecode(b"caf\xe9") if fault_id == "search-hup-first-probe" else "runs")
    search = _start(
        "search", "--model", "tiny-llama", "--device", "cpu", "--budget", "5m", "--out", os.fsdecode(out), cwd=tmp_path
    )
    child = int(_wait_for("*/logs/fake-child.pid", out).read_text())  # the first probe is running
    run = next(out.iterdir())
    search.send_signal(SEARCH_SIGNALS[fault_id])
    _, err_bytes = search.communicate(timeout=120)
    err = err_bytes.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:  # the probe child ends with its search
        time.sleep(0.1)
    assert _gone(child)
    if fault.exit_code == 130:
        assert search.returncode == 130 and fault.message in err, err
        word = err.split("--resume ", 1)[1].split()[0]  # a shell word that bash reads back as the folder
        found = subprocess.run(["bash", "-c", f"cat {word}/spec.yaml"], capture_output=True, check=False)
        assert found.returncode == 0 and found.stdout == (run / "spec.yaml").read_bytes(), found.stderr
    report = subprocess.run(
        [sys.executable, "-m", "autofit", "report", os.fsencode(run)],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    said = report.stdout.decode("utf-8", "replace")  # the folder's name, as the file system has it
    assert report.returncode == 0 and "not finished" in said, report.stderr
    text = (run / "report.md").read_text(encoding="utf-8")
    assert "Nothing fits" not in text and "## No fit yet" in text and "**not finished**" in text
    if fault.exit_code == 0:
        assert fault.message in said


def test_a_signal_after_the_command_has_ended_leaves_its_exit_code(tmp_path: Path) -> None:
    """Python puts the default actions back as it finalizes: a signal then killed the process, and the
    job runner saw 129 instead of the search's 3."""
    fault = next(f for f in FAULTS if f.id == "search-hup-after-its-end")
    search = _start(
        "search",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--memory-limit",
        "1MiB",
        "--out",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert search.stderr is not None
    said = b""
    while b"Report: " not in said:  # its last line: the work is done, the interpreter shuts down
        line = search.stderr.readline()
        assert line, said
        said += line
    search.send_signal(signal.SIGHUP)
    search.communicate(timeout=60)
    assert fault.message in said.decode()
    assert search.returncode in (fault.exit_code, 130), search.returncode  # 130: the signal beat its last return


def test_a_search_whose_terminal_closed_runs_to_its_end_under_nohup(tmp_path: Path) -> None:
    """`nohup` ignores SIGHUP, so the search outlives its terminal; every write to the terminal then fails
    (EIO). Every probe runs out of memory (the fake child), so the search ends, with its own exit 3."""
    fault = next(f for f in FAULTS if f.id == "search-nohup-terminal-closed")
    master, terminal = pty.openpty()
    env = {**os.environ, **fake_env("cuda_oom"), "PYTHONPATH": str(ROOT)}

    def nohup() -> None:
        _default_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    search = subprocess.Popen(
        cpu_search("1m", str(tmp_path)),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
        preexec_fn=nohup,
    )
    os.close(terminal)
    os.close(master)  # the terminal is gone before the search says a word
    assert search.wait(timeout=300) == fault.exit_code
    run = next(tmp_path.iterdir())
    assert fault.message in (run / "report.md").read_text() and (run / "trials.jsonl").read_text().strip()


@pytest.mark.parametrize("fault_id", ["probe-hup", "probe-sigpipe"])
def test_a_probe_stopped_by_a_signal_stops_its_child_and_exits_130(tmp_path: Path, fault_id: str) -> None:
    fault = next(f for f in FAULTS if f.id == fault_id)
    probe = _start("probe", "--model", "tiny-llama", "--device", "cpu", "--log-dir", str(tmp_path), cwd=tmp_path)
    child = int(_wait_for("fake-child.pid", tmp_path).read_text())
    if fault_id == "probe-sigpipe":  # no reader is gone: nothing to stop; the probe goes on
        probe.send_signal(signal.SIGPIPE)
        time.sleep(1)
        assert probe.poll() is None and not _gone(child)
    probe.send_signal(signal.SIGHUP if fault_id == "probe-hup" else signal.SIGTERM)
    _, err = probe.communicate(timeout=60)
    assert probe.returncode == fault.exit_code and fault.message in err.decode(), err
    assert "Traceback" not in err.decode()
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


def test_data_hung_up_while_it_starts_exits_130_without_a_traceback(tmp_path: Path) -> None:
    fault = next(f for f in FAULTS if f.id == "data-hup-starting")
    (tmp_path / "train.jsonl").write_text('{"text": "a b c d"}\n')
    data = _start("data", str(tmp_path / "train.jsonl"), "--model", "tiny-llama", cwd=tmp_path)
    _wait_for_handler(data.pid, signal.SIGHUP)  # the command's own handlers are set first thing, then it imports
    data.send_signal(signal.SIGHUP)
    _, err = data.communicate(timeout=60)
    assert data.returncode == fault.exit_code and fault.message in err.decode(), err
    assert "Traceback" not in err.decode()


MARK_UNHANDLED = """
import ctypes
import sys

run = ctypes.pythonapi.PyRun_String
run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]


class Mark:  # once the command imports its command line (`python -m` clears the mark before it runs the module)
    def find_spec(self, name, path=None, target=None):
        if name == "autofit.cli":
            sys.meta_path.remove(self)
            try:
                run(b"raise KeyboardInterrupt", 257, {}, {})  # 257: Py_file_input
            except KeyboardInterrupt:
                pass
        return None


sys.meta_path.insert(0, Mark())
"""


def test_an_interruption_exits_130_where_cpython_marked_a_keyboard_interrupt_unhandled(tmp_path: Path) -> None:
    """CPython marks a KeyboardInterrupt that passed through PyRun_String (some extension modules run Python
    that way while they import) as unhandled even where it was caught, and a `python -m` run then ends itself by
    SIGINT after finalizing: `data-hup-starting` exited -2 once in CI when the signal landed there. Marked here
    as the command imports its command line (a sitecustomize's import hook), the interrupted command still exits
    130."""
    fault = next(f for f in FAULTS if f.id == "data-hup-starting")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(MARK_UNHANDLED)
    (tmp_path / "train.jsonl").write_text('{"text": "a b c d"}\n')
    env = {**os.environ, **fake_env("hang"), "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"}
    data = subprocess.Popen([sys.executable, "-m", "autofit", "data", str(tmp_path / "train.jsonl"), "--model",
                             "tiny-llama"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
                            preexec_fn=_default_signals)
    _wait_for_handler(data.pid, signal.SIGHUP)
    data.send_signal(signal.SIGHUP)
    _, err = data.communicate(timeout=60)
    assert data.returncode == fault.exit_code and fault.message in err.decode(), (data.returncode, err)
    assert "Traceback" not in err.decode()
