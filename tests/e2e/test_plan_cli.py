"""`autofit plan` as a user runs it: real processes, no GPU, seconds."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, run_cli

from autofit.core.envinfo import gpus

D2 = ROOT / "tests" / "data" / "d2-slice.jsonl"


def test_every_card_in_one_line_each() -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "all")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(x.startswith("T4 ") and "does not fit: a 4-bit base" in x for x in lines)
    assert any(x.startswith("A100 40GB ") and "fits: L=2048" in x for x in lines)
    assert lines[-1].startswith("next: autofit search --model llama2-7b --memory-limit ")


def test_one_card_with_a_dataset_plans_for_the_datas_lengths() -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "RTX 4090", "--dataset", str(D2), "--top", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "worst-case sample: line" in out and "max_length candidates" in out
    assert "usable 22.4 GiB" in out or "usable 22.5 GiB" in out
    assert out.count("weights 12.6 GiB") == 2 and "longest max_length predicted to fit" in out
    assert f"--dataset {D2}" in out


def test_json_for_scripts_and_exit_3_when_nothing_fits(tmp_path: Path) -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--memory-limit", "8GiB", "--json")
    assert proc.returncode == 3, proc.stderr
    (plan,) = json.loads(proc.stdout)["plans"]
    assert plan["best"] is None and plan["fits"] == 0 and "4-bit" in plan["smallest_saving"]
    assert "nothing in the space is predicted to fit 8 GiB" in proc.stderr and "Traceback" not in proc.stderr


def test_without_a_card_it_plans_for_this_gpu_or_says_what_to_give() -> None:
    proc = run_cli("plan", "--model", "llama2-7b")
    if gpus():  # a GPU machine: its own card
        assert proc.returncode in (0, 3) and "next: autofit search" in proc.stdout
    else:
        assert proc.returncode == 2 and "--card or --memory-limit: this machine has no GPU" in proc.stderr
    bad = run_cli("plan", "--model", "llama2-7b", "--card", "V100")
    assert bad.returncode == 2 and "is not a card autofit knows" in bad.stderr


def test_a_headroom_search_refuses_is_refused() -> None:
    """100% would leave no memory (and read as no limit: every config 'fits'); search refuses it, so does plan."""
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "RTX 4090", "--headroom", "100%")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "autofit: error: --headroom: 1.0 is out of range; expected a fraction such as 0.05.\n"

