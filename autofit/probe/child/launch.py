"""`python -m autofit.probe.child.launch N REQUEST_FILE`: torchrun with N probe ranks (started by the
runner)."""

from __future__ import annotations

import sys

from autofit.probe.child.ranks import launch

if len(sys.argv) != 3:
    print("usage: python -m autofit.probe.child.launch N REQUEST_FILE (started by the runner)",
          file=sys.stderr)
    sys.exit(2)
sys.exit(launch(sys.argv[1:]))
