"""Real DPO probes in child processes: a search of the tiny DPO space on a preference file finds a winner and its
report shows pairs/s; `autofit data` shows the pairs' lengths; `autofit probe --dataset` trains TRL's DPOTrainer
on a file's pairs, the longest micro-batch first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_cli

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One search of the tiny DPO space on prefs.jsonl's pairs (at the space's length), shared."""
    out = tmp_path_factory.mktemp("dpo")
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--space", str(DATA / "dpo-space.yaml"),
                   "--dataset", str(DATA / "prefs.jsonl"), "--max-length", "128", "--budget", "40s", "--out",
                   str(out / "runs"), "--json", cwd=out)
    assert proc.returncode == 0, proc.stderr
    (run,) = (out / "runs").iterdir()
    return run


def test_a_dpo_search_finds_a_winner_and_reports_pairs_per_s(dpo_run: Path) -> None:
    best = json.loads((dpo_run / "best.json").read_text())
    res = best.get("result", best)
    assert res["config"]["trainer"] == "dpo" and res["outcome"] == "fit"
    assert res["pairs_per_s"] > 0 and res["config"]["batching"] == "pad_longest"
    # both rows of the file's pairs, not random tokens at max_length (2 x 128)
    assert 0 < res["extra"]["tokens_per_pair"] < 2 * 128
    spec = yaml.safe_load((dpo_run / "spec.yaml").read_text())
    assert spec["dataset"]["kind"] == "preference" and spec["dataset"]["samples"] == 40
    assert run_cli("report", str(dpo_run), cwd=dpo_run.parent).returncode == 0
    report = (dpo_run / "report.md").read_text()
    # the export it suggests works: TRL's DPO script, also the default format of a DPO winner
    assert "--format trl -o train.py`" in report and "--format hf-trainer" not in report
    assert "| pairs per optimizer step |" in report  # a DPO step's global batch counts pairs
    recipe = dpo_run.parent / "default.py"
    proc = run_cli("export", str(dpo_run), "-o", str(recipe), cwd=dpo_run.parent)
    assert proc.returncode == 0, proc.stderr
    assert "DPOTrainer(" in recipe.read_text()
    assert f"pairs/s** ({res['extra']['tokens_per_pair']} tokens a pair)" in report.split("## Winner")[1]
    if not res["config"].get("precompute_ref_log_probs"):  # the reference's forward is in the step's breakdown
        assert "DPO reference" in report
    # the pairs' lengths and what the winner's max_length cuts, from the summary the search wrote
    pairs = json.loads((dpo_run / "data" / "preferences.json").read_text())
    data = report.split("## Data")[1].split("\n## ")[0]
    assert "40 preference pairs" in data
    longest = pairs["percentiles"]["pair"]["p100"]
    assert "| pair | " in data and f"{longest:,.0f} |" in data.split("| pair | ")[1].split("\n")[0]
    (cut,) = [c for c in pairs["cuts"] if c["max_length"] == 128]
    assert (f"Winner's max_length 128: {cut['pairs_dropped']} pairs dropped, {cut['pairs_truncated']} truncated, "
            f"{cut['completion_tokens_lost']:.2%} of completion tokens lost") in data


def test_autofit_data_shows_the_pairs_lengths(tmp_path: Path) -> None:
    proc = run_cli("data", str(DATA / "prefs.jsonl"), "--model", "tiny-llama", "--out", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "40 preference pairs" in proc.stdout and "max_length    192: 0 pairs dropped" in proc.stdout
    for part in ("prompt", "chosen", "rejected", "pair"):
        assert any(line.startswith(part) for line in proc.stdout.splitlines())
    # the SFT field flags name no field of a pair: said, not silently ignored
    proc = run_cli("data", str(DATA / "prefs.jsonl"), "--model", "tiny-llama", "--text-field", "body", "--out",
                   str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0 and "--text-field ignored:" in proc.stderr, proc.stderr
    # a length beyond the model's positions is refused, as search and plan refuse it (tiny-llama: 8192)
    proc = run_cli("data", str(DATA / "prefs.jsonl"), "--model", "tiny-llama", "--max-length", "100000", "--out",
                   str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "--max-length: max_length 100000 is longer than" in proc.stderr, proc.stderr


def probe_on_prefs(tmp_path: Path, setting: str) -> dict[str, Any]:
    """`autofit probe` of a small LoRA DPO config on prefs.jsonl with one more `--set`: its JSON result."""
    sets = ["trainer=dpo", "max_length=128", "micro_batch_size=2", "global_batch=4", "batching=pad_longest",
            "optimizer=adamw_torch", "lora_r=8", "lora_alpha=16", setting]
    proc = run_cli("probe", "--model", "tiny-llama", "--device", "cpu", "--dataset", str(DATA / "prefs.jsonl"),
                   *[x for v in sets for x in ("--set", v)], "--log-dir", str(tmp_path / "logs"), "--json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_a_probe_trains_dpo_on_the_pairs_of_a_file(tmp_path: Path) -> None:
    """Every second layer checkpointed: so it stays through the reference's forwards (TRL's own turns every layer
    back on), and the probe checks the layers again when training ends."""
    res = probe_on_prefs(tmp_path, "gradient_checkpointing=every_2")
    assert res["outcome"] == "fit", res["reason"]
    assert res["checkpointed_layers"] == [0, 2]  # tiny-llama: 4 layers
    # the longest pairs first: the heaviest micro-batch is two pairs padded to the longest of them, 2 rows each
    assert res["extra"]["heaviest_tensor_tokens"] == 2 * 2 * 128  # prefs.jsonl's two longest pairs are cut at 128
    assert res["extra"]["mean_micro_batch_tensor_tokens"] < res["extra"]["heaviest_tensor_tokens"]
    assert 0 < res["extra"]["tokens_per_pair"] < 2 * 128 and res["pairs_per_s"]
    assert "rewards/margins" in res["extra"]["dpo_last_log"]
    model = res["extra"]["time_model"]  # the window's own fixed cost and cost per token brought it to the mean
    assert model["seconds_per_micro_batch"] >= 0 and model["seconds_per_tensor_token"] > 0


def test_a_precomputed_pass_is_counted_per_pair_past_its_first_batches_and_the_hash_over_the_file(
        tmp_path: Path) -> None:
    """The pass runs in DPOTrainer's constructor: each batch timed, the first two (the process's first forwards)
    left out of its cost a pair, and TRL's hash of the weights (its cache key, paid once a run) spread over the
    file's pairs; the figure adds that cost to each pair's step time."""
    res = probe_on_prefs(tmp_path, "precompute_ref_log_probs=true")
    extra = res["extra"]
    assert res["outcome"] == "fit", res["reason"]
    batches = extra["precompute_batches"]
    assert [n for n, _ in batches] == [2] * len(batches) and 2 * len(batches) == extra["precompute_pairs"]
    steady = batches[2:]
    expected = (sum(t for _, t in steady) / sum(n for n, _ in steady)
                + extra["precompute_hash_seconds"] / (40 - extra["pairs_dropped"]))  # prefs.jsonl: 40 pairs
    assert extra["precompute_hash_seconds"] > 0 and extra["precompute_s_per_pair"] == pytest.approx(expected, 1e-3)
    assert extra["precompute_seconds"] >= sum(t for _, t in batches)  # the batches are inside the pass
    assert 1 / res["pairs_per_s"] > extra["precompute_s_per_pair"]  # the step's own time on top of it
