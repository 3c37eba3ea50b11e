"""autofit.core.paths: what a file system can hand autofit as a path, refused with the flag named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autofit.core import paths
from autofit.core.errors import UsageError


@pytest.mark.parametrize("case", ["missing", "folder", "fifo", "device", "loop", "too-long"])
def test_an_input_file_that_is_no_regular_file_names_the_flag_and_what_it_is(tmp_path: Path, case: str) -> None:
    target = {"missing": tmp_path / "nope.jsonl", "folder": tmp_path, "fifo": tmp_path / "fifo",
              "device": Path("/dev/zero"), "loop": tmp_path / "a", "too-long": tmp_path / ("x" * 300)}[case]
    if case == "fifo":
        os.mkfifo(target)
    if case == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
    expected = {"missing": "does not exist", "folder": "is a folder, not a regular file",
                "fifo": r"is a FIFO \(named pipe\), not a regular file", "device": "is a character device",
                "loop": "symbolic link loop", "too-long": "name too long"}[case]
    with pytest.raises(UsageError, match=expected) as e:
        paths.input_file(target, "--dataset")
    assert str(e.value).startswith("--dataset: ")


def test_an_output_file_checks_its_folder_and_name_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a folder; give a file name"):
        paths.output_file(tmp_path, "-o")
    with pytest.raises(UsageError, match="the folder .* does not exist"):
        paths.output_file(tmp_path / "missing" / "x.py", "-o")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="has a file where a folder is expected"):
        paths.output_file(tmp_path / "file" / "x.py", "-o")
    with pytest.raises(UsageError, match="is a name too long for the file system"):
        paths.output_file(tmp_path / ("y" * 300), "--json")
    assert paths.output_file("/dev/null", "--json") == Path("/dev/null")
    assert paths.output_file(tmp_path / "new.py", "-o") == tmp_path / "new.py"
