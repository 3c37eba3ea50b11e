"""A stand-in for one rank of a probe spanning several ranks (started by the real torchrun).

The rank named by FAKE_RANK (default 1) does what FAKE_RANK_MODE says: `raise` (a Python error, exit
1), `oom` (print the real CUDA out-of-memory text and exit 1, what cannot happen on a CPU machine) or
`hang` (sleep, never joining the group). Every other rank is the real probe rank.
"""

import os
import sys
import time

from oom_text import CUDA_OOM  # torchrun runs this file as a script: its folder is on sys.path

if os.environ.get("RANK") != os.environ.get("FAKE_RANK", "1"):
    from autofit.probe.child.ranks import rank_main

    sys.exit(rank_main(sys.argv[2]))
with open(sys.argv[2] + f".fake-rank-{os.environ['RANK']}.pid", "w") as f:
    f.write(str(os.getpid()))
mode = os.environ.get("FAKE_RANK_MODE", "raise")
if mode == "raise":
    raise RuntimeError("autofit test: this rank failed on purpose")
if mode == "oom":
    sys.stderr.write(CUDA_OOM)
    sys.exit(1)
from autofit.protocol.request import die_with_parent  # noqa: E402

die_with_parent()  # tied to the launcher, as a real rank is first thing
time.sleep(3600)  # hang
