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


PREFS = ROOT / "tests" / "data" / "prefs.jsonl"


def test_a_headroom_search_refuses_is_refused() -> None:
    """100% would leave no memory (and read as no limit: every config 'fits'); search refuses it, so does plan."""
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "RTX 4090", "--headroom", "100%")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("autofit: error: --headroom: 1.0 is out of range; expected a fraction from 0 up to (not "
                           "including) 0.5, such as 0.05 (5%).\n")


def test_a_dpo_space_plans_for_the_preference_pairs() -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "RTX 4090", "--space", "dpo", "--dataset", str(PREFS),
                   "--top", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "40 preference pairs" in out and "worst-case pair: line 8, 142 tokens" in out
    assert f"next: autofit search --model llama2-7b --space dpo --dataset {PREFS} --memory-limit 24210MiB" in out


def test_too_many_gpus_names_gpus_once() -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "H100", "--gpus", "32")
    assert proc.returncode == 2 and proc.stderr.count("autofit: error:") == 1, proc.stderr
    assert proc.stderr.startswith("autofit: error: --gpus 32: more GPUs than samples per optimizer step (the "
                                  "space's global batch 16)") and "lora.yaml" not in proc.stderr


def test_the_next_search_carries_the_plans_flags_or_the_saving() -> None:
    data = "tests/data/d1-slice.jsonl"  # --text-field reads --dataset's rows: refused without it
    proc = run_cli("plan", "--model", "llama2-7b", "--memory-limit", "40GiB", "--global-batch", "4", "--headroom",
                   "7%", "--dataset", data, "--text-field", "text", "--gpus", "2", "--max-length", "1024", "--top",
                   "0", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "  1  L=" not in proc.stdout  # --top 0: no config listed
    assert proc.stdout.splitlines()[-1] == (
        f"next: autofit search --model llama2-7b --dataset {data} --text-field text --max-length 1024 "
        "--global-batch 4 --gpus 2 --memory-limit 40GiB --headroom 7% --budget 30m")
    t4 = run_cli("plan", "--model", "llama2-7b", "--card", "T4")  # nothing fits: the search of QLoRA
    assert t4.returncode == 3 and t4.stdout.splitlines()[-1] == (
        "next: autofit search --model llama2-7b --space qlora --memory-limit 15101MiB --budget 30m")


def test_an_ambiguous_card_says_which_it_planned_for() -> None:
    proc = run_cli("plan", "--model", "llama2-7b", "--card", "A100", "--top", "0")
    assert proc.returncode == 0 and "on A100 40GB (" in proc.stdout
    assert "--card A100: planned for the A100 40GB; for the A100 80GB give --card 'A100 80GB'." in proc.stderr
