"""The data package wired into the commands: `autofit data`, `--dataset` on search and probe, the probe
on real batches (issue 11)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, run_cli

from autofit.cli import main

D1 = ROOT / "tests" / "data" / "d1-slice.jsonl"
CHAT = ROOT / "tests" / "data" / "d1-chat-slice.jsonl"


# ----------------------------------------------------------------------------- autofit data


def _recomputed(out: Path) -> np.ndarray:
    """The lengths the command cached, read without the data package."""
    (table,) = out.glob("lengths-*.json")
    return np.array(json.loads(table.read_text())["lengths"])


def test_data_command_prints_percentiles_recomputed_independently(tmp_path: Path, capsys) -> None:
    assert main(["data", str(D1), "--model", "tiny-llama", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    values = _recomputed(tmp_path)
    for q in (50, 90, 95, 99, 99.9, 100):
        assert f"p{q:g} {np.percentile(values, q):.1f}" in text
    cover = int(np.ceil(values.max() / 64) * 64)
    lost = np.clip(values - 448, 0, None).sum() / values.sum()
    assert f"{cover:>10}" in text and f"{lost:.2%}" in text
    assert "approximate" in text and (tmp_path / "lengths.png").stat().st_size > 1000


def test_data_command_json_with_the_users_lengths(tmp_path: Path, capsys) -> None:
    assert main(["data", str(CHAT), "--model", "tiny-llama", "--out", str(tmp_path), "--json",
                 "--max-length", "64", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    values = _recomputed(tmp_path)
    assert out["candidates"] == [64, 128] and out["approximate"] is True
    assert out["cuts"][0]["samples_truncated"] == pytest.approx((values > 64).mean())
    assert out["percentiles"]["p90"] == pytest.approx(np.percentile(values, 90))


@pytest.mark.parametrize(("content", "args", "match"), [
    ("", (), "PATH: .*is empty"),
    ('{"prompt": "x"}\n', (), "no usable row .*missing 'text'.*--text-field"),
    ('{"text": "x"}\n', ("--max-length", "0"), "--max-length: 0 is not a length"),
    ('{"text": "x"}\n', ("--model", "nope-model"), "--model"),
])
def test_data_command_bad_inputs_exit_2_with_a_message(tmp_path: Path, capsys, content: str, args: tuple,
                                                       match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    argv = ["data", str(path), "--out", str(tmp_path / "o"), *args]
    if "--model" not in args:
        argv += ["--model", "tiny-llama"]
    assert main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.slow
def test_data_command_in_a_process_reports_bad_rows_and_never_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one sample"}\n{broken\n{"text": "two samples here"}\n')
    ok = run_cli("data", str(path), "--model", "tiny-llama", "--out", str(tmp_path / "o"))
    assert ok.returncode == 0, ok.stderr
    assert "1 rows skipped: 1 not JSON (line 2)" in ok.stderr and "2 samples" in ok.stdout
    missing = run_cli("data", str(tmp_path / "none.jsonl"), "--model", "tiny-llama")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "no such file" in missing.stderr
