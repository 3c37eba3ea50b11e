"""One rank of a probe spanning several GPUs (or CPU processes), and the launcher that starts them.

`python -m autofit.probe.child.launch N REQUEST_FILE` is the process the runner starts for a config with
`gpus` = N > 1: it ties itself to the runner (it dies with it) and runs torchrun in-process
(`torch.distributed.run.main`, standalone rendezvous on a free port, no restarts), which starts N
ranks of `python -m autofit.probe.child --rank REQUEST_FILE`. Each rank reads the request from the file
(torchrun gives the ranks no stdin of their own), trains its share of the global batch through
Trainer (which joins the process group torchrun prepared: NCCL on GPUs, gloo on the CPU), writes
its own result (`rank_result_path`) and exits; a rank whose outcome is not a fit exits with code 1,
so that torchrun stops the others at once instead of leaving them waiting in a collective. Rank 0
alone speaks the protocol (the timed phase's start and end). The runner merges the ranks' results
(`autofit.protocol.group`).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import tempfile
from pathlib import Path

from autofit.config.distributed import rank_threads
from autofit.probe.child.main import protocol_pipe, serve
from autofit.protocol.request import PARENT_ENV, ProbeRequest, die_with_parent, rank_result_path

RANK_ENV = "AUTOFIT_RANK_COMMAND"
"""Tests replace what torchrun starts for each rank with a program that follows the same protocol
(a rank that raises, hangs or prints a CUDA OOM); nothing else should set this."""


def launch(argv: list[str]) -> int:
    """`N REQUEST_FILE`: torchrun with N ranks of the probe, tied to the runner's life."""
    nproc, request = argv
    die_with_parent()
    from torch.distributed.run import main as torchrun  # the heavy import, after the tie to the runner

    if os.environ.get(RANK_ENV):
        rank = shlex.split(os.environ[RANK_ENV])
    else:  # torchrun starts `python -m`: the working folder off the ranks' path (paths.python_module)
        rank = ["-m", "autofit.probe.child"]
        os.environ["PYTHONSAFEPATH"] = "1"
    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent: they die with this process
    # torchrun gives each rank one thread unless told: an offloaded optimizer step would run on one core
    os.environ.setdefault("OMP_NUM_THREADS", str(rank_threads(int(nproc))))
    # torchrun keeps per-rank logs in a folder of its own (mkdtemp otherwise, left behind every time)
    with tempfile.TemporaryDirectory(prefix=".torchrun-", dir=Path(request).parent) as logs:
        # --tee=2: each rank's stderr also reaches the probe's log, every line marked "[default<k>]:"
        # (the runner tells the ranks' errors apart); stdout stays the protocol pipe, unmarked
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", f"--log-dir={logs}",
                  "--tee=2", *rank, "--rank", request])
    return 0


def rank_main(request_file: str) -> int:
    """One rank: the request from the file, the probe, this rank's result."""
    pipe = protocol_pipe()  # PARENT_ENV is the launcher's: a rank never outlives its group
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    req = ProbeRequest.from_json(Path(request_file).read_text())
    req = dataclasses.replace(
        req, result_path=rank_result_path(req.result_path, rank),
        nvml_index=req.nvml_indices[local] if req.nvml_indices else req.nvml_index)
    res = serve(req, pipe if rank == 0 else _silent, f"autofit probe rank {rank}")
    os._exit(0 if res.outcome.is_fit() else 1)  # not a fit: torchrun stops the other ranks now


def _silent(event: str) -> None:
    """Ranks other than 0 say nothing on the protocol pipe (rank 0 speaks for the group)."""
