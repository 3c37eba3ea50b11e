from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_CHILD = Path(__file__).resolve().parent / "fake_child.py"


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # preset weights saved for quantized probes go to a throwaway cache
    os.environ["AUTOFIT_CACHE"] = str(tmp_path_factory.mktemp("autofit-cache"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def probe_json(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    proc = run_cli("probe", "--model", "tiny-llama", "--device", "cpu", "--json", *args, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def fake_env(mode: str) -> dict[str, str]:
    return {"AUTOFIT_PROBE_COMMAND": f"{sys.executable} {FAKE_CHILD}", "FAKE_MODE": mode}
