"""autofit.core.files: every file written whole or not at all, a history line never joined to a cut one,
and one rule for "cannot write"."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import matplotlib
import pytest
from faults import full_disk

from autofit.core import files

matplotlib.use("Agg")


def test_a_write_that_fills_the_disk_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with full_disk(disk, "1m", lambda d: (d / "best.json").write_text('{"old": 1}\n')):
        with pytest.raises(OSError) as e:
            files.write_atomic(disk / "best.json", "x" * 2_000_000)
        assert files.cannot_write(e.value)
        assert (disk / "best.json").read_text() == '{"old": 1}\n'
        assert sorted(p.name for p in disk.iterdir()) == ["best.json", "filler"]


def test_a_new_file_on_a_full_disk_is_not_created_at_all(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with full_disk(disk, "1m"):
        with pytest.raises(OSError):
            files.write_atomic(disk / "train.py", "print('hello')\n" * 10_000)
        assert not (disk / "train.py").exists()


def test_a_plot_that_fills_the_disk_leaves_no_damaged_image(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    disk = tmp_path / "disk"
    fig, ax = plt.subplots()
    ax.plot(range(1000), range(1000))
    with full_disk(disk, "1m"):
        with pytest.raises(OSError):
            files.save_figure(fig, disk / "trend.png")
        assert not (disk / "trend.png").exists() and [p.name for p in disk.iterdir()] == ["filler"]
    files.save_figure(fig, tmp_path / "trend.png")
    assert (tmp_path / "trend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)


def test_a_new_record_after_a_cut_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    history = tmp_path / "regress-history.jsonl"
    whole = json.dumps({"night": 1}) + "\n"
    history.write_text(whole + json.dumps({"night": 2})[:7])  # the second record cut mid-way
    files.append_line(history, json.dumps({"night": 3}))
    lines = history.read_text().split("\n")
    assert lines[0] == whole.strip() and json.loads(lines[2]) == {"night": 3} and lines[3] == ""
    files.append_line(history, json.dumps({"night": 4}))  # an intact end gets no blank line
    assert history.read_text().endswith('{"night": 3}\n{"night": 4}\n')


def test_the_written_file_has_the_permissions_open_would_give(tmp_path: Path) -> None:
    files.write_atomic(tmp_path / "new.txt", "a")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o666 & ~umask
    (tmp_path / "old.sh").write_text("")
    (tmp_path / "old.sh").chmod(0o750)
    files.write_atomic(tmp_path / "old.sh", "b")
    assert (tmp_path / "old.sh").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize(("error", "expected"), [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EROFS, "Read-only file system"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (OSError(errno.ENOENT, "No such file or directory"), False),
    (RuntimeError("(sqlite3.OperationalError) database or disk is full"), True),
    (RuntimeError("attempt to write a readonly database"), True),
    (RuntimeError("no such table: trials"), False),
])
def test_cannot_write_tells_a_refused_write_from_other_failures(error: BaseException, expected: bool) -> None:
    assert files.cannot_write(error) is expected


def test_a_device_or_fifo_target_is_written_into_never_replaced(tmp_path: Path) -> None:
    files.write_atomic("/dev/null", "nothing")
    assert Path("/dev/null").is_char_device()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        files.write_atomic(fifo, "through the pipe")
        assert os.read(reader, 100) == b"through the pipe"
        assert fifo.is_fifo()
    finally:
        os.close(reader)


def test_a_link_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    dated = tmp_path / "regress-2026-12-05.json"
    dated.write_text("{}")
    (tmp_path / "latest.json").symlink_to(dated.name)
    files.write_json(tmp_path / "latest.json", {"verdict": "pass"})
    assert (tmp_path / "latest.json").is_symlink() and json.loads(dated.read_text()) == {"verdict": "pass"}
