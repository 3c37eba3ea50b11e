"""The child-process entry point, where training happens.

`python -m autofit.probe.child --standby` imports torch, transformers and peft, says it is
ready, and waits for one `ProbeRequest` on stdin (protocol.py). It then runs that probe
through transformers Trainer, exactly as the exported recipe will (measure.py), writes one
`ProbeResult` as JSON to the request's `result_path` and exits. One process, one probe: the
memory it reports is a fresh process's. CUDA is not touched before the request arrives, so
a standby process holds no GPU memory while another probe runs. The protocol the probe
follows is described in docs/DESIGN.md ("The probe").
"""

from __future__ import annotations

import json
import logging
import os
import select
import sys
from collections.abc import Callable
from typing import IO

from autofit.core.envinfo import package_versions
from autofit.probe.child.dpo import run_dpo_probe
from autofit.probe.child.judge import failure_result, judge_limit
from autofit.probe.child.measure import run_probe
from autofit.probe.child.state import ProbeState
from autofit.protocol.request import (
    READY,
    TIMED_END,
    TIMED_START,
    ProbeRequest,
    die_with_parent,
    write_json_atomic,
)
from autofit.protocol.result import ProbeResult

GO_AHEAD_WAIT_S = 10.0
"""How long a probe waits for the runner's go-ahead before timing anyway (the runner may be old or gone)."""


class _DropMissingCpuKernel(logging.Filter):
    """bitsandbytes warns on every import on a CPU with AVX512-BF16 that it could not fetch an
    optional kernel from the hub (it falls back to its own); this message alone is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


def silence_known_noise() -> None:
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMissingCpuKernel())


def handle(req: ProbeRequest, announce: Callable[[str], None]) -> ProbeResult:
    state = ProbeState()
    try:
        res = (run_dpo_probe if req.config.trainer == "dpo" else run_probe)(req, state, announce)
    except BaseException as exc:  # every failure becomes an outcome; the runner judges the rest
        if isinstance(exc, KeyboardInterrupt):
            raise
        res = failure_result(req, exc, state)
    res = judge_limit(res, req.memory_limit_bytes, req.headroom)
    res.device = req.device_label
    res.model = req.model.ref
    res.versions = package_versions()
    return res


class ProtocolPipe:
    """The child's side of the protocol pipe: the ready line, the timed phase's start and end."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def __call__(self, event: str) -> None:
        """`start`: tell the runner and wait for its go-ahead (it holds other imports); `end`."""
        if event == "start":
            self.say(TIMED_START)
            ready, _, _ = select.select([sys.stdin], [], [], GO_AHEAD_WAIT_S)
            if ready:
                sys.stdin.readline()
        else:
            self.say(TIMED_END)


def protocol_pipe() -> ProtocolPipe:
    """A probe process's start: tied to its parent (`PARENT_ENV`), its stdout kept as the protocol pipe
    and everything else the libraries print sent to the log."""
    die_with_parent()
    pipe = ProtocolPipe(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)  # anything the libraries print goes to the log, not the protocol pipe
    silence_known_noise()
    return pipe


def serve(req: ProbeRequest, announce: Callable[[str], None], who: str = "autofit probe") -> ProbeResult:
    """Run the request, write its result, say both in the log."""
    print(f"{who}: {json.dumps(req.config.to_dict())}", file=sys.stderr, flush=True)
    res = handle(req, announce)
    write_json_atomic(req.result_path, res.to_dict())
    print(f"{who}: {res.outcome.value} {res.reason}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    return res


def warm_adapters() -> None:
    """A throwaway adapter on a one-layer module, before the probe's memory baseline: peft 0.22's get_peft_model
    imports bitsandbytes' dispatch (and with it torch._dynamo, sympy, networkx) on first use, 49 MiB of host
    memory that the CPU probe counted as the config's (tiny-llama's 48 MiB fit read 96 MiB over a 90 MiB limit)."""
    import torch
    from peft import LoraConfig, get_peft_model

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(4, 4)

    get_peft_model(One(), LoraConfig(r=1, target_modules=["q"]))


def standby() -> int:
    """Import, announce readiness, serve one request."""
    pipe = protocol_pipe()
    import peft  # noqa: F401
    import torch  # noqa: F401  the expensive part, done before a request arrives
    import transformers  # noqa: F401
    from transformers import Trainer, TrainingArguments  # noqa: F401

    warm_adapters()
    pipe.say(READY)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the runner closed the pipe (or died): nothing to do
    serve(ProbeRequest.from_json(line), pipe)
    os._exit(0)  # skip interpreter teardown: the result is written, the runner is waiting
