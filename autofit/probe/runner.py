"""Starts probes in child processes, enforces timeouts, classifies outcomes.

Each probe runs in a fresh process, so its memory figures are a fresh process's. The imports are paid
ahead of time by `standby.py`'s processes. The evidence for an outcome is trusted in this order: the result
the child wrote, the runner's own timeout or cancellation, the signal that ended the
child (a SIGKILL is the OOM killer's only on evidence, `kills.py`), the signatures in its
log, its exit code. Children die with the process that started them (protocol.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from autofit.config import distributed, kernels
from autofit.config.models import ModelSource
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.core.documents import JSONObject
from autofit.core.envinfo import package_versions
from autofit.core.files import write_atomic
from autofit.core.paths import python_module
from autofit.probe.standby import HOLD, Standby, writable_logs
from autofit.protocol import group
from autofit.protocol.kills import SAMPLE_EVERY_S, KillWatch
from autofit.protocol.request import (
    MAX_PROBE_ACCUMULATION,
    PARENT_ENV,
    TIMED_STEPS,
    WARMUP_STEPS,
    Checks,
    ProbeRequest,
    rank_result_path,
    write_json_atomic,
)
from autofit.protocol.result import Outcome, ProbeResult
from autofit.protocol.signatures import classify_text, result_from_log


class ProbeRunner(Protocol):
    """What runs a search's probes on one target: `Runner` (each probe a process of its own) or the landscape
    replay's `search.replay.ReplayRunner` (recorded results on a simulated clock). `search.Search` takes
    either."""

    def warm_up(self) -> None:
        """Start what the first probe needs (standby processes) before it is asked for."""

    def run(self, cfg: TrialConfig, model: ModelSource, *, name: str, timeout: float = 900.0,
            cancel: Callable[[], bool] | None = None, checks: Checks = Checks()) -> ProbeResult:
        """One probe of `cfg` named `name`, always a result: a timeout after `timeout` seconds, cancelled
        when `cancel()` says so, running the correctness `checks` asked for."""
        ...

    def abort(self) -> None:
        """From another thread (Ctrl-C): stop the probe running now."""

    def close(self) -> None:
        """Stop everything started (standby processes); the runner is not used again."""


def result_file(log_dir: Path, name: str) -> Path:
    """Where the probe called `name` writes its result (a resumed search adopts a finished one)."""
    return Path(log_dir) / f"{name}.result.json"


class Runner:
    """Runs probes one at a time on one target, with standby processes importing ahead."""

    def __init__(self, target: Target, log_dir: Path, *, standby: int = 1,
                 warmup_steps: int = WARMUP_STEPS, timed_steps: int = TIMED_STEPS,
                 max_probe_accumulation: int | None = MAX_PROBE_ACCUMULATION,
                 hold_while_timing: bool = True, train_tokens: int | None = None,
                 train_steps: int | None = None,
                 dataset: JSONObject | None = None, data_cache: Path | None = None) -> None:
        self.target = target
        self.log_dir = Path(log_dir).resolve()
        writable_logs(self.log_dir)
        self.standby_count = max(0, standby)
        """Processes kept importing ahead, besides the one a probe needs now (0: start on demand)."""
        self.warmup_steps = warmup_steps
        self.timed_steps = timed_steps
        self.max_probe_accumulation = max_probe_accumulation
        self.hold_while_timing = hold_while_timing
        self.dataset = dataset
        """`DatasetRef.to_dict()` with --dataset: every probe trains on its micro-batches."""
        self.data_cache = str(Path(data_cache).resolve()) if data_cache is not None else None
        """False only to measure what the hold removes (bench/noise_bench.py): imports run on."""
        self.train_tokens = train_tokens
        """The planned training length, stamped on each result (compile time is amortised over it)."""
        self.train_steps = train_steps
        """The same in optimizer steps, when given instead (`planned_tokens`)."""
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

    def _env(self, gpus: int = 1) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env[PARENT_ENV] = str(os.getpid())
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        if self.target.device == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # same numbering as nvidia-smi and NVML
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.target.gpus[:gpus]))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        pkg_root = str(Path(__file__).resolve().parents[2])  # the folder that holds the autofit package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        return env

    def _start_one(self) -> None:
        self._seq += 1
        self._pool.append(Standby(self.log_dir, self._env(), self._seq))

    def _fill(self) -> None:
        if self._aborted.is_set():
            return
        self._pool = [s for s in self._pool if s.alive() or not s.ready.is_set()]
        while len(self._pool) < self.standby_count:
            self._start_one()

    def warm_up(self) -> None:
        """Start the standby processes now (they import while the caller does other work)."""
        self._fill()

    def _take(self, deadline: float) -> Standby | None:
        if self._aborted.is_set():
            return None
        self._fill()
        if not self._pool:
            self._start_one()
        while time.monotonic() < deadline:
            for s in sorted(self._pool, key=lambda s: s.started):
                if s.ready.is_set():
                    self._pool.remove(s)
                    HOLD.discard(s)
                    s.hold_while_timing = self.hold_while_timing
                    self._fill()
                    return s
            time.sleep(0.02)
        return None

    def close(self) -> None:
        for s in self._pool:
            s.kill()
            s.discard_log()
        self._pool = []

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one probe -----------------------------------------------------------------------

    def request(self, cfg: TrialConfig, model: ModelSource, result_path: Path,
                checks: Checks = Checks()) -> ProbeRequest:
        t = self.target
        return ProbeRequest(
            config=cfg, model=model, result_path=str(result_path), device=t.device,
            device_label=t.describe(long=True), nvml_index=t.gpu_index,
            memory_limit_bytes=t.memory_limit_bytes, headroom=t.headroom,
            warmup_steps=self.warmup_steps, timed_steps=self.timed_steps,
            max_probe_accumulation=self.max_probe_accumulation,
            gate=checks.gate and kernels.needs_gate(cfg),
            boundaries=checks.boundaries and self.dataset is not None,
            dataset=self.dataset, data_cache=self.data_cache,
            nvml_indices=list(t.gpus[:cfg.gpus]) if distributed.launched(cfg) else [],
        )

    def judged_before(self, cfg: TrialConfig) -> ProbeResult | None:
        """An outcome known without a child: kernels, engines or a number of GPUs this machine cannot
        run (`unsupported`)."""
        why = kernels.kernel_support(cfg, self.target.device) or distributed.support(
            cfg, self.target.device, len(self.target.gpus), self.dataset is not None)
        if why:
            return ProbeResult(Outcome.UNSUPPORTED, cfg, reason=f"autofit: unsupported: {why}")
        return None

    def run(self, cfg: TrialConfig, model: ModelSource, *, name: str, timeout: float = 900.0,
            cancel: Callable[[], bool] | None = None, checks: Checks = Checks()) -> ProbeResult:
        """Run one probe and always return a result; KeyboardInterrupt stops the child first.
        `checks`: the correctness checks to run (all by default; the search leaves out those its
        study has passing verdicts for)."""
        res = self._run(cfg, model, name, timeout, cancel, checks)
        if not res.model:  # a result the parent made (a timeout, a kill): the child's identity fields too
            res.model, res.versions = model.ref, res.versions or package_versions()
        return res

    def _run(self, cfg: TrialConfig, model: ModelSource, name: str, timeout: float,
             cancel: Callable[[], bool] | None, checks: Checks) -> ProbeResult:
        asked = time.monotonic()
        deadline = asked + timeout
        result_path = result_file(self.log_dir, name)
        log_path = self.log_dir / f"{name}.log"
        result_path.unlink(missing_ok=True)
        known = self.judged_before(cfg)
        if known is not None:
            return self._finish(known, asked, log_path, "")
        req = self.request(cfg, model, result_path, checks)
        if distributed.launched(cfg):
            return self._run_group(req, name, asked, deadline, timeout, cancel)
        child = self._take(deadline)
        if child is None:
            return self._finish(ProbeResult(Outcome.TIMEOUT, cfg,
                                            reason=f"no probe process was ready within {timeout:.0f} s"),
                                asked, log_path, "")
        return self._supervise(child, req, log_path, asked, deadline, timeout, cancel)

    def _supervise(self, child: Standby, req: ProbeRequest, log_path: Path, asked: float, deadline: float,
                   timeout: float, cancel: Callable[[], bool] | None) -> ProbeResult:
        """Drive one started child (a standby, or a group's launcher) to its end and judge it; Ctrl-C
        stops it first."""
        group = distributed.launched(req.config)
        self._current = child
        try:
            child.name_log(log_path)
            ended = self._drive(child, req, deadline, cancel, send=not group)
            text = log_path.read_text(errors="replace")
            if group:
                res = self._judge_group(ended, timeout, req, text)
                return self._finish(res, asked, log_path, f"pid {child.proc.pid} ({req.config.gpus} ranks)")
            return self._finish(self._judge(child, ended, timeout, req, text), asked, log_path,
                                f"pid {child.proc.pid}")
        except KeyboardInterrupt:
            child.kill()
            self.close()
            raise
        finally:
            self._current = None

    def _run_group(self, req: ProbeRequest, name: str, asked: float, deadline: float, timeout: float,
                   cancel: Callable[[], bool] | None) -> ProbeResult:
        """A probe spanning `gpus` ranks: torchrun started now (no standby: ranks import on demand),
        the request in a file, every rank's result merged (`group.merge`)."""
        n = req.config.gpus
        log_path = self.log_dir / f"{name}.log"
        request_file = self.log_dir / f"{name}.request.json"
        write_atomic(request_file, req.to_json())  # the launcher never reads half a request
        for r in range(n):
            Path(rank_result_path(req.result_path, r)).unlink(missing_ok=True)
        self._seq += 1
        child = Standby(self.log_dir, self._env(n), self._seq,
                        cmd=[*python_module("autofit.probe.child.launch"), str(n), str(request_file)])
        child.hold_while_timing = self.hold_while_timing  # its timed steps hold standbys still importing
        try:
            return self._supervise(child, req, log_path, asked, deadline, timeout, cancel)
        finally:
            request_file.unlink(missing_ok=True)

    def _judge_group(self, ended: Ended, timeout: float, req: ProbeRequest, text: str) -> ProbeResult:
        cfg = req.config
        results = {}
        for r in range(req.config.gpus):
            path = Path(rank_result_path(req.result_path, r))
            if path.is_file():
                results[r] = _read_result(path, cfg, text[-4000:])
                path.unlink()
        if ended.cancelled:
            return ProbeResult(Outcome.CANCELLED, cfg, reason="cancelled: another worker probes this config")
        if ended.timed_out and not any(not r.outcome.is_fit() for r in results.values()):
            return ProbeResult(Outcome.TIMEOUT, cfg, error_tail=text[-4000:],
                               reason=(f"no result after {timeout:.0f} s from ranks "
                                       f"{sorted(set(range(req.config.gpus)) - set(results))}; every rank "
                                       "of the group was stopped"))
        if self._aborted.is_set() and not group.ended(results, req.config.gpus, text):
            return ProbeResult(Outcome.CRASH, cfg, retryable=True, error_tail=text[-4000:],
                               reason="interrupted: the group was stopped before it ended")
        res = group.merge(results, req.config.gpus, cfg, text)
        cause = group.root_cause(text)
        if cause is not None and cause.exitcode == -signal.SIGKILL and res.outcome is Outcome.CRASH:
            res = _outside_sigkill(cfg, res.error_tail, ended.watch.host_oom_evidence(cause.pid)
                                   if cause.pid else None, f"rank {cause.rank} ")
        # where a single probe's child leaves its result: a search resumed after this process died adopts it
        write_json_atomic(req.result_path, res.to_dict())
        return res

    def _drive(self, child: Standby, req: ProbeRequest, deadline: float,
               cancel: Callable[[], bool] | None, send: bool = True) -> Ended:
        """Send the request and wait for the child to end, our deadline, or a cancellation."""
        ended = Ended(KillWatch.start())
        if send:
            child.send(req.to_json() + "\n")  # if it died before the request: judged from what it left
        last_cancel = last_sample = 0.0
        while child.proc.poll() is None:
            now = time.monotonic()
            if now >= deadline:
                ended.timed_out = True
                break
            if cancel is not None and now - last_cancel > 1.0:
                last_cancel = now
                if cancel():
                    ended.cancelled = True
                    break
            if now - last_sample >= SAMPLE_EVERY_S:
                last_sample = now
                ended.watch.sample()
            time.sleep(0.02)
        if ended.timed_out or ended.cancelled:
            self._ours_killed.add(child.proc.pid)
            child.kill()
        else:
            child.wait()
        return ended

    def _judge(self, child: Standby, ended: Ended, timeout: float, req: ProbeRequest,
               text: str) -> ProbeResult:
        cfg = req.config
        rc, pid = child.proc.returncode, child.proc.pid
        tail = text[-4000:]
        # 1. the result the child wrote
        if Path(req.result_path).is_file():
            return _read_result(Path(req.result_path), cfg, tail)
        # 2. our own cancellation (another worker owns this config) or timeout
        if ended.cancelled:
            return ProbeResult(Outcome.CANCELLED, cfg, reason="cancelled: another worker probes this config")
        if ended.timed_out:
            return ProbeResult(Outcome.TIMEOUT, cfg, error_tail=tail,
                               reason=f"no result after {timeout:.0f} s; the probe's process group was "
                                      "stopped")
        # 3. the signal that ended it
        if rc is not None and rc < 0:
            if -rc == signal.SIGKILL and pid not in self._ours_killed:
                return _outside_sigkill(cfg, tail, ended.watch.host_oom_evidence(pid))
            return ProbeResult(classify_text(text) or Outcome.CRASH, cfg, error_tail=tail,
                               reason=f"ended by signal {signal.Signals(-rc).name}")
        # 4. what it printed
        return _from_text(cfg, text, rc)

    def _finish(self, res: ProbeResult, asked: float, log_path: Path, worker: str) -> ProbeResult:
        res.wall_seconds = time.monotonic() - asked
        res.train_tokens = planned_tokens(res.config, self.train_tokens, self.train_steps)
        res.log_path = str(log_path)
        res.worker = worker
        if not res.device:
            res.device = self.target.describe(long=True)
        if res.memory_limit_bytes is None:
            res.memory_limit_bytes = self.target.memory_limit_bytes
        return res


class Ended:
    """How the wait for one child ended, and the evidence gathered meanwhile."""

    def __init__(self, watch: KillWatch) -> None:
        self.watch = watch
        self.timed_out = False
        self.cancelled = False


def _read_result(path: Path, cfg: TrialConfig, tail: str) -> ProbeResult:
    try:
        return ProbeResult.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        return ProbeResult(Outcome.CRASH, cfg, reason=f"unreadable result file ({e})", error_tail=tail)


def _outside_sigkill(cfg: TrialConfig, tail: str, evidence: str | None, who: str = "") -> ProbeResult:
    """A SIGKILL autofit did not send (to the child, or to `who`: a group's rank): the OOM killer's on
    evidence, else says nothing about the config."""
    if evidence is not None:
        return ProbeResult(Outcome.HOST_OOM, cfg, error_tail=tail,
                           reason=f"{who}killed by SIGKILL from the host's OOM killer: {evidence}")
    return ProbeResult(Outcome.CRASH, cfg, error_tail=tail, retryable=True,
                       reason=f"{who}killed by SIGKILL from outside autofit (no sign of the OOM killer)")


def _from_text(cfg: TrialConfig, text: str, rc: int | None) -> ProbeResult:
    """A child that exited without a result: what its log shows."""
    res = result_from_log(cfg, text, f"exited with code {rc} without writing a result")
    if res.outcome is Outcome.OOM:
        lines = [ln for ln in text.splitlines() if "out of memory" in ln.lower() or "OutOfMemory" in ln]
        res.reason = (lines[-1].strip()[:300] if lines else res.reason)
    return res


def planned_tokens(cfg: TrialConfig, train_tokens: int | None, train_steps: int | None) -> int | None:
    """The planned training length in tokens that a compile is amortised over: `train_steps` optimizer
    steps of this config (its effective batch x max_length tokens each; with a dataset an upper bound),
    else `train_tokens`."""
    if train_steps:
        return train_steps * cfg.effective_batch * cfg.max_length
    return train_tokens
