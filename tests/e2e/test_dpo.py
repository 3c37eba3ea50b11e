"""Real DPO probes in child processes: a search of the tiny DPO space finds a winner and its report shows
pairs/s; a probe on a preference file trains TRL's DPOTrainer on its pairs, the longest micro-batch first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.data.preference import preference_ref_dict, read_preferences
from autofit.probe.runner import Runner
from autofit.protocol.result import Outcome

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One search of the tiny DPO space (random tokens at max_length: the worst case), shared."""
    out = tmp_path_factory.mktemp("dpo")
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--space", str(DATA / "dpo-space.yaml"),
                   "--budget", "40s", "--out", str(out / "runs"), "--json", cwd=out)
    assert proc.returncode == 0, proc.stderr
    (run,) = (out / "runs").iterdir()
    return run


def test_a_dpo_search_finds_a_winner_and_reports_pairs_per_s(dpo_run: Path) -> None:
    best = json.loads((dpo_run / "best.json").read_text())
    res = best.get("result", best)
    assert res["config"]["trainer"] == "dpo" and res["outcome"] == "fit"
    assert res["pairs_per_s"] > 0 and res["extra"]["tokens_per_pair"] == 2 * 128  # both rows at max_length
    report = (dpo_run / "report.md").read_text()
    assert "pairs/s** (256.0 tokens a pair)" in report.split("## Winner")[1]
    if not res["config"].get("precompute_ref_log_probs"):  # the reference's forward is in the step's breakdown
        assert "DPO reference" in report


def test_a_probe_trains_dpo_on_the_pairs_of_a_file(tmp_path: Path) -> None:
    prefs = read_preferences(DATA / "prefs.jsonl")
    cfg = TrialConfig(trainer="dpo", max_length=128, micro_batch_size=2, global_batch=4, batching="pad_longest",
                      optimizer="adamw_torch", lora_r=8, lora_alpha=16)
    with Runner(Target(), tmp_path / "logs", standby=0, dataset=preference_ref_dict(prefs),
                data_cache=tmp_path / "cache") as runner:
        res = runner.run(cfg, resolve_model("tiny-llama"), name="dpo-data")
    assert res.outcome is Outcome.FIT, res.reason + res.error_tail
    # the longest pairs first: the heaviest micro-batch is two pairs padded to the longest of them, 2 rows each
    assert res.extra["heaviest_tensor_tokens"] == 2 * 2 * 128  # prefs.jsonl's two longest pairs are cut at 128
    assert res.extra["mean_micro_batch_tensor_tokens"] < res.extra["heaviest_tensor_tokens"]
    assert 0 < res.extra["tokens_per_pair"] < 2 * 128 and res.pairs_per_s
    assert "rewards/margins" in res.extra["dpo_last_log"]
