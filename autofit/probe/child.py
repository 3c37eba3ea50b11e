"""The child-process entry point, where training happens.

`python -m autofit.probe --standby` imports torch, transformers and peft, says it is
ready, and waits for one request on stdin (JSON). It then runs that probe through
transformers Trainer, exactly as the exported recipe will, writes one `ProbeResult` as
JSON to the request's `result_path` and exits. One process, one probe: the memory it
reports is a fresh process's. CUDA is not touched before the request arrives, so a
standby process holds no GPU memory while another probe runs.

The protocol (DESIGN.md): `model.train()`, `use_cache=False`, checkpointing verified per
layer; every sequence is `max_length` tokens; warm-up optimizer steps, then timed steps
with `synchronize()` at the boundaries; median and spread of non-padding tokens/s; peak =
reserved + memory outside the allocator; per-phase peaks; growth flagged; non-finite loss
is `unstable`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..envinfo import package_versions
from ..protocol import READY
from ..result import ProbeResult
from .child_io import write_json_atomic
from .judge import failure_result, judge_limit
from .measure import run_probe


def handle(req: dict[str, Any]) -> ProbeResult:
    partial: dict[str, Any] = {}
    try:
        res = run_probe(req, partial)
    except BaseException as exc:  # every failure becomes an outcome; the runner judges the rest
        if isinstance(exc, KeyboardInterrupt):
            raise
        res = failure_result(req, exc, partial)
    res = judge_limit(res, req.get("memory_limit_bytes"), float(req.get("headroom", 0.05)))
    res.device = req["device_label"]
    res.model = req["model"]["ref"]
    res.versions = package_versions()
    return res



def standby() -> int:
    """Import, announce readiness, serve one request."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the libraries print goes to the log, not the protocol pipe
    import peft  # noqa: F401
    import torch  # noqa: F401  the expensive part, done before a request arrives
    import transformers  # noqa: F401
    from transformers import Trainer, TrainingArguments  # noqa: F401

    proto.write(READY + "\n")
    proto.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    req = json.loads(line)
    print(f"autofit probe: {json.dumps(req['config'])}", file=sys.stderr, flush=True)
    res = handle(req)
    write_json_atomic(req["result_path"], res.to_dict())
    print(f"autofit probe: {res.outcome.value} {res.reason}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the result is written, the runner is waiting
