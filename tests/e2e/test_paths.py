"""autofit.core.paths: what a file system can hand autofit as a path, refused with the flag named."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from autofit.core import paths


def test_a_name_that_is_not_utf8_is_shown_so_bash_reads_it_back(tmp_path: Path) -> None:
    name = os.fsdecode(b"run-\xe9t\xe9 'x'")
    (tmp_path / name).mkdir()
    word = paths.shown(tmp_path / name)
    out = subprocess.run(["bash", "-c", f"cd {word} && pwd"], capture_output=True, check=True).stdout
    assert out.rstrip(b"\n") == os.fsencode(tmp_path / name)
