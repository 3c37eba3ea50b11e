"""`python -m autofit.probe --standby`: the probe child (started by the runner)."""

from __future__ import annotations

import sys

from .child import standby

if sys.argv[1:] != ["--standby"]:
    print("usage: python -m autofit.probe --standby (started by the runner)", file=sys.stderr)
    sys.exit(2)
sys.exit(standby())
