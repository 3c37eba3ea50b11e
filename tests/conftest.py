from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA_DIR = TESTS / "data"
"""Committed inputs: dataset slices, the suite's search space, recorded regress nights."""
SUPPORT = TESTS / "support"
"""What tests/unit and tests/e2e share: fault rows, stored runs, the stand-in children. Its modules are
imported by name (`from faults import Fault`), as tests/ itself is (`from conftest import run_cli`): both
folders are on the path whatever folder pytest was started on."""
for _folder in (SUPPORT, TESTS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
FAKE_CHILD = SUPPORT / "fake_child.py"

# Every process the suite starts (probes, recipes, ranks) and this one compute on one thread: torch's
# OpenMP threads, two per process on a 2-core machine, spin against each other's and against any other
# job's, and a 6 s probe took 30 s beside a second suite. The figures a probe measures are not what the
# tests check; an environment that sets its own count keeps it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A suite started in the background (`nohup pytest &` from a script) inherits SIGINT ignored, and so would
# every autofit it starts: the Ctrl-C tests would find their signal dropped. A handler is reset to the
# default in a new program, where an ignored signal stays ignored; so the suite takes Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # preset weights saved for quantized probes go to a throwaway cache
    os.environ["AUTOFIT_CACHE"] = str(tmp_path_factory.mktemp("autofit-cache"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    # this checkout's package, whatever the working directory (an installed copy may be elsewhere)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "autofit", *args], check=False, capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def probe_json(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               model: str = "tiny-llama") -> dict[str, Any]:
    proc = run_cli("probe", "--model", model, "--device", "cpu", "--json", *args, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def fake_env(mode: str) -> dict[str, str]:
    return {"AUTOFIT_PROBE_COMMAND": f"{sys.executable} {FAKE_CHILD}", "FAKE_MODE": mode}


# tests/data/oom-space.yaml under this limit: length 2048 runs out of memory, length 128 fits.
SEARCH_SPACE = str(DATA_DIR / "oom-space.yaml")
SEARCH_LIMIT = "90MiB"


def cpu_search(budget: str, out: str, *extra: str) -> list[str]:
    """The command line of a real `autofit search` of tiny-llama over SEARCH_SPACE under SEARCH_LIMIT on the CPU."""
    return [sys.executable, "-m", "autofit", "search", "--model", "tiny-llama", "--space", SEARCH_SPACE, "--device",
            "cpu", "--memory-limit", SEARCH_LIMIT, "--budget", budget, "--out", out, *extra]


def search_cli(out: Path, *args: str, budget: str = "60s", env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run_cli("search", "--model", "tiny-llama", "--space", SEARCH_SPACE, "--device", "cpu",
                   "--memory-limit", SEARCH_LIMIT, "--budget", budget, "--out", str(out), "--json", *args,
                   env=env, timeout=timeout)


def read_trials(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "trials.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real search on the CPU, shared by the tests that read its run folder (copy before editing)."""
    out = tmp_path_factory.mktemp("runs")
    # It ends on "no remaining configuration can win" in ~70 s here; the budget leaves room for a
    # slower machine, where a budget-bound search might not keep time to measure the best again.
    proc = search_cli(out, budget="120s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(json.loads(proc.stdout)["run_dir"])


@pytest.fixture(scope="session")
def unreachable_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete run folder in two seconds: a search under a 1 MiB limit, which the memory model proves
    nothing can fit, so it ends before any probe (exit 3). For tests of what reads or rewrites a run
    folder (copy before editing)."""
    out = tmp_path_factory.mktemp("unreachable")
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--memory-limit", "1MiB", "--budget", "1m",
                   "--out", str(out), "--json")
    assert proc.returncode == 3, proc.stderr[-3000:]
    return Path(json.loads(proc.stdout)["run_dir"])


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real PostgreSQL server: AUTOFIT_TEST_POSTGRES, or a private instance started here."""
    if os.environ.get("AUTOFIT_TEST_POSTGRES"):
        yield os.environ["AUTOFIT_TEST_POSTGRES"]
        return
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    assert initdb and pg_ctl, ("PostgreSQL server binaries not found: install Debian's postgresql package "
                               "(.ci/run does) or set AUTOFIT_TEST_POSTGRES to a server URL")
    base = Path(tempfile.mkdtemp(prefix="autofit-pg-"))  # reachable by the postgres user
    data = base / "data"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
        os.chmod(base, 0o777)
        as_user = ["runuser", "-u", "postgres", "--"]
    init = subprocess.run([*as_user, initdb, "-D", str(data), "-U", "autofit", "--auth=trust"],
                          check=False, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-l", str(base / "log"), "-w", "-o",
                    f"-p {port} -k {base} -c listen_addresses=127.0.0.1", "start"], check=True, capture_output=True)
    subprocess.run([_pg_bin("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "autofit",
                    "autofit_test"], check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://autofit@127.0.0.1:{port}/autofit_test"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "fast", "stop"], check=False, capture_output=True)
