"""Writing the result file: atomically, so the runner never reads half a result."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
