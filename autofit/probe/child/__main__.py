"""`python -m autofit.probe.child --standby` (a probe child) or `--rank REQUEST_FILE` (one rank of a probe
spanning several GPUs, started by torchrun): both are started by the runner."""

from __future__ import annotations

import sys

from autofit.probe.child.main import standby
from autofit.probe.child.ranks import rank_main

if sys.argv[1:] == ["--standby"]:
    sys.exit(standby())
if len(sys.argv) == 3 and sys.argv[1] == "--rank":
    sys.exit(rank_main(sys.argv[2]))
print("usage: python -m autofit.probe.child --standby | --rank REQUEST_FILE (started by the runner)",
      file=sys.stderr)
sys.exit(2)
