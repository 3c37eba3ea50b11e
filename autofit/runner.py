"""Starts probes in child processes, enforces timeouts, classifies outcomes.

Each probe runs in a fresh process, so its memory figures are a fresh process's. The
16-20 s that importing torch + transformers + peft costs is paid ahead of time: the
runner keeps `standby` processes that have imported everything (and not touched CUDA)
waiting for a request. The evidence for an outcome is trusted in this order: the result
the child wrote, the runner's own timeout, the signal that ended the child, the
signatures in its log, its exit code.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .models import ModelSource
from .protocol import READY
from .result import Outcome, ProbeResult
from .signatures import classify_text, oom_shortfall
from .spec import TrialConfig
from .target import Target

# Tests replace the child with a small program that follows the same protocol (a CUDA OOM
# cannot happen on a CPU machine); nothing else should set this.
CHILD_ENV = "AUTOFIT_PROBE_COMMAND"


def result_file(log_dir: Path, name: str) -> Path:
    """Where the probe called `name` writes its result (a resumed search adopts a finished one)."""
    return Path(log_dir) / f"{name}.result.json"


class Standby:
    """One child process that has imported the training stack and waits for a request."""

    def __init__(self, log_dir: Path, env: dict[str, str], seq: int) -> None:
        self.log_path = log_dir / f".standby-{os.getpid()}-{seq}.log"
        self.log = open(self.log_path, "wb")
        cmd = shlex.split(os.environ[CHILD_ENV]) if os.environ.get(CHILD_ENV) else [
            sys.executable, "-m", "autofit.probe", "--standby"]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            start_new_session=True,  # its own process group: a timeout or Ctrl-C stops all of it
        )
        self.started = time.monotonic()
        self.ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # anything but the ready line is ignored
            if raw.decode(errors="replace").strip() == READY:
                self.ready.set()
                return
        self.ready.set()  # ended without being ready: the caller sees it has exited

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()


class Runner:
    """Runs probes one at a time on one target, with standby processes importing ahead."""

    def __init__(self, target: Target, log_dir: Path, *, standby: int = 1,
                 warmup_steps: int = 2, timed_steps: int = 5,
                 max_probe_accumulation: int | None = 4) -> None:
        self.target = target
        self.log_dir = Path(log_dir).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.standby_count = max(0, standby)
        """Processes kept importing ahead, besides the one a probe needs now (0: start on demand)."""
        self.warmup_steps = warmup_steps
        self.timed_steps = timed_steps
        self.max_probe_accumulation = max_probe_accumulation
        self._pool: list[Standby] = []
        self._seq = 0
        self._ours_killed: set[int] = set()
        self._current: Standby | None = None
        self._aborted = threading.Event()

    def abort(self) -> None:
        """From another thread (Ctrl-C): stop the running probe's process group and the standbys."""
        self._aborted.set()
        child = self._current
        if child is not None:
            self._ours_killed.add(child.proc.pid)
            child.kill()
        for s in list(self._pool):
            s.kill()

    # -- standby pool -------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        if self.target.device == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # same numbering as nvidia-smi and NVML
            env["CUDA_VISIBLE_DEVICES"] = str(self.target.gpu_index)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        return env

    def _fill(self) -> None:
        if self._aborted.is_set():
            return
        self._pool = [s for s in self._pool if s.alive() or not s.ready.is_set()]
        while len(self._pool) < self.standby_count:
            self._seq += 1
            self._pool.append(Standby(self.log_dir, self._env(), self._seq))

    def warm_up(self) -> None:
        """Start the standby processes now (they import while the caller does other work)."""
        self._fill()

    def _take(self, deadline: float) -> Standby | None:
        if self._aborted.is_set():
            return None
        self._fill()
        if not self._pool:
            self._seq += 1
            self._pool.append(Standby(self.log_dir, self._env(), self._seq))
        while time.monotonic() < deadline:
            for s in sorted(self._pool, key=lambda s: s.started):
                if s.ready.is_set():
                    self._pool.remove(s)
                    self._fill()
                    return s
            time.sleep(0.02)
        return None

    def close(self) -> None:
        for s in self._pool:
            s.kill()
            s.log_path.unlink(missing_ok=True)
        self._pool = []

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one probe -----------------------------------------------------------------------

    def request(self, cfg: TrialConfig, model: ModelSource, result_path: Path) -> dict[str, Any]:
        t = self.target
        return {
            "config": cfg.to_dict(),
            "model": model.to_dict(),
            "device": t.device,
            "device_label": t.describe(long=True),
            "gpu_index": t.gpu_index,
            "gpu_name": t.gpu_name,
            "nvml_index": t.gpu_index,
            "memory_limit_bytes": t.memory_limit_bytes,
            "headroom": t.headroom,
            "warmup_steps": self.warmup_steps,
            "timed_steps": self.timed_steps,
            "max_probe_accumulation": self.max_probe_accumulation,
            "result_path": str(result_path),
        }

    def run(self, cfg: TrialConfig, model: ModelSource, *, name: str, timeout: float = 900.0,
            cancel: Callable[[], bool] | None = None) -> ProbeResult:
        """Run one probe and always return a result; KeyboardInterrupt stops the child first."""
        asked = time.monotonic()
        deadline = asked + timeout
        result_path = result_file(self.log_dir, name)
        log_path = self.log_dir / f"{name}.log"
        result_path.unlink(missing_ok=True)
        req = self.request(cfg, model, result_path)
        child = self._take(deadline)
        if child is None:
            return self._finish(ProbeResult(Outcome.TIMEOUT, cfg.to_dict(),
                                            reason=f"no probe process was ready within {timeout:.0f} s"),
                                asked, log_path, "")
        self._current = child
        try:
            return self._drive(child, req, cfg, asked, deadline, timeout, result_path, log_path, cancel)
        except KeyboardInterrupt:
            child.kill()
            self.close()
            raise
        finally:
            self._current = None

    def _drive(self, child: Standby, req: dict[str, Any], cfg: TrialConfig, asked: float,
               deadline: float, timeout: float, result_path: Path, log_path: Path,
               cancel: Callable[[], bool] | None) -> ProbeResult:
        assert child.proc.stdin is not None
        timed_out = cancelled = False
        try:
            child.proc.stdin.write((json.dumps(req) + "\n").encode())
            child.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # it died before the request: judged below from what it left
        last_cancel_check = 0.0
        while child.proc.poll() is None:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if cancel is not None and now - last_cancel_check > 1.0:
                last_cancel_check = now
                if cancel():
                    cancelled = True
                    break
            time.sleep(0.02)
        if timed_out or cancelled:
            self._ours_killed.add(child.proc.pid)
            child.kill()
        else:
            child.proc.wait()
            child.log.close()
        child.log_path.replace(log_path)
        text = log_path.read_text(errors="replace")
        res = self._judge(child.proc.returncode, child.proc.pid, timed_out, cancelled, timeout,
                          result_path, text, cfg)
        return self._finish(res, asked, log_path, f"pid {child.proc.pid}")

    def _judge(self, rc: int | None, pid: int, timed_out: bool, cancelled: bool, timeout: float,
               result_path: Path, text: str, cfg: TrialConfig) -> ProbeResult:
        # 1. the result the child wrote
        if result_path.is_file():
            try:
                return ProbeResult.from_dict(json.loads(result_path.read_text()))
            except (ValueError, KeyError, TypeError) as e:
                return ProbeResult(Outcome.CRASH, cfg.to_dict(), reason=f"unreadable result file ({e})",
                                   error_tail=text[-4000:])
        # 2. our own timeout (or a cancellation: another worker owns this config)
        if cancelled:
            return ProbeResult(Outcome.CRASH, cfg.to_dict(), reason="cancelled: another worker probes this config")
        if timed_out:
            return ProbeResult(Outcome.TIMEOUT, cfg.to_dict(), error_tail=text[-4000:],
                               reason=f"no result after {timeout:.0f} s; the probe's process group was stopped")
        # 3. the signal that ended it; a SIGKILL we did not send is the kernel's OOM killer
        if rc is not None and rc < 0:
            sig = -rc
            if sig == signal.SIGKILL and pid not in self._ours_killed:
                return ProbeResult(Outcome.HOST_OOM, cfg.to_dict(), error_tail=text[-4000:],
                                   reason="killed by SIGKILL that autofit did not send (the host's OOM killer)")
            outcome = classify_text(text) or Outcome.CRASH
            return ProbeResult(outcome, cfg.to_dict(), error_tail=text[-4000:],
                               reason=f"ended by signal {signal.Signals(sig).name}")
        # 4. what it printed
        outcome = classify_text(text) or Outcome.CRASH
        res = ProbeResult(outcome, cfg.to_dict(), error_tail=text[-4000:],
                          reason=f"exited with code {rc} without writing a result")
        if outcome is Outcome.OOM:
            res.oom_shortfall_bytes = oom_shortfall(text)
            lines = [ln for ln in text.splitlines() if "out of memory" in ln.lower() or "OutOfMemory" in ln]
            res.reason = (lines[-1].strip()[:300] if lines else res.reason)
        return res

    def _finish(self, res: ProbeResult, asked: float, log_path: Path, worker: str) -> ProbeResult:
        res.wall_seconds = time.monotonic() - asked
        res.log_path = str(log_path)
        res.worker = worker
        if not res.device:
            res.device = self.target.describe(long=True)
        if res.memory_limit_bytes is None:
            res.memory_limit_bytes = self.target.memory_limit_bytes
        return res
