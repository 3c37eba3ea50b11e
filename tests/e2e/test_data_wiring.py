"""The data package wired into the commands: `autofit data`, `--dataset` on search and probe, the probe
on real batches (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from autofit.config.spec import BATCHINGS
from runs import D1, moved_run

# ----------------------------------------------------------------------------- autofit data


def test_data_command_in_a_process_reports_bad_rows_and_never_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one sample"}\n{broken\n{"text": "two samples here"}\n')
    ok = run_cli("data", str(path), "--model", "tiny-llama", "--out", str(tmp_path / "o"))
    assert ok.returncode == 0, ok.stderr
    assert "1 row skipped: 1 not JSON (line 2)" in ok.stderr and "2 samples" in ok.stdout
    missing = run_cli("data", str(tmp_path / "none.jsonl"), "--model", "tiny-llama")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "no such file" in missing.stderr


# ----------------------------------------------------------------------------- the probe on real batches


def _probe(tmp_path: Path, strategy: str, **sets: object):
    from autofit.config.models import resolve_model
    from autofit.config.spec import TrialConfig
    from autofit.config.target import resolve_targets
    from autofit.data import DatasetRef, load_samples
    from autofit.probe.runner import Runner

    cfg = TrialConfig.from_mapping({"max_length": 96, "micro_batch_size": 2, "global_batch": 4,
                                    "precision": "fp32", "batching": strategy, **sets})
    ref = DatasetRef.of(load_samples(D1))
    (target,) = resolve_targets(None, "cpu", None, 0.05)
    with Runner(target, tmp_path / "logs", standby=0, dataset=ref.to_dict(), data_cache=tmp_path / "data") as r:
        return cfg, r.run(cfg, resolve_model("tiny-llama"), name=f"probe-{strategy}", timeout=600)


def _check_strategy_figures(tmp_path: Path, rows: list[dict]) -> None:
    """Each strategy's probe trained on the data as the plan says: the heaviest micro-batch first
    (recomputed from the data, independently of the probe), its padding and its samples per step."""
    from autofit.config.models import resolve_model
    from autofit.data import Batching, load_samples, plan, tokenizer_for
    from autofit.data.batching import step_shape

    data = load_samples(D1)
    ids = tokenizer_for(resolve_model("tiny-llama"), data, tmp_path / "data").encode(data.samples)
    for row in rows:
        strategy, extra = row["config"]["batching"], row["extra"]
        assert row["outcome"] == "fit", (strategy, row["reason"], row["error_tail"][-2000:])
        assert extra["batching"] == strategy and row["tokens_per_s"] > 0 and row["step_times"]
        p = plan(Batching(strategy), [len(t) for t in ids], 96, 2, 0)
        assert extra["heaviest_tensor_tokens"] == p.heaviest.tensor_tokens, strategy
        if strategy == "pad_max":
            assert extra["heaviest_tensor_tokens"] == 2 * 96 and extra["pad_fraction"] > 0.2
        if strategy == "packed":  # rows of several samples: the accumulation keeps the global batch on average
            n = len(p.batches)
            want = step_shape(p.strategy, row["config"]["global_batch"], 2, 1, p.samples_per_micro_batch,
                              p.trained_tokens / n)
            assert extra["gradient_accumulation_steps"] == want.accumulation, strategy
            assert extra["samples_per_step"] == pytest.approx(want.samples, abs=0.01)
        else:  # micro-batch 2 x accumulation 2, padded or flattened
            assert (extra["samples_per_step"], extra["gradient_accumulation_steps"]) == (4, 2), strategy
        if strategy == "padding_free":
            assert extra["pad_fraction"] == 0
        assert 0 < extra["tokens_lost"] < 1


def test_a_packed_probe_passes_the_loss_check_and_reports_its_verdict(tmp_path: Path) -> None:
    """packed's figures (the dataset search below runs it leaking), and the check's key and verdict
    that the search learns from (`Knowledge.checks`)."""
    from autofit.data.correctness import boundary_key

    cfg, res = _probe(tmp_path, "packed")
    _check_strategy_figures(tmp_path, [res.to_dict()])
    assert res.extra["boundary_key"] == boundary_key(cfg) and res.extra["boundaries"]["ok"] is True
    assert res.extra["boundaries"]["max_loss_diff"] <= res.extra["boundaries"]["tolerance"]


# ----------------------------------------------------------------------------- search --dataset


SMALL_SPACE = """\
fixed: {global_batch: 4, micro_batch_size: 2, precision: fp32, optimizer: adamw_torch, lora_r: 8, lora_alpha: 16}
dimensions:
  gradient_checkpointing: [off, on]
"""


def _leak_verdicts(run: Path, rows: list[dict]) -> None:
    """packed leaked (the test-only layout): one probe, a mismatch; the study, as stored, skips
    packed's other config; every other strategy's loss check ran once (its later probes skip it)."""
    from autofit.config.models import resolve_model
    from autofit.config.spec import TrialConfig
    from autofit.data.correctness import boundary_key
    from autofit.estimate.memory import Shape
    from autofit.run.rundir import load_spec
    from autofit.search.knowledge import Knowledge, Verdict
    from autofit.search.study import open_study

    (leak,) = [r for r in rows if r["config"]["batching"] == "packed"]
    assert leak["outcome"] == "mismatch" and "samples sharing a row see each other" in leak["reason"]
    assert leak["extra"]["boundaries"]["max_loss_diff"] > 10 * leak["extra"]["boundaries"]["tolerance"]
    spec = load_spec(run)
    trials = open_study(spec.storage, spec.study_name, create=False, seed=0).get_trials()
    know = Knowledge.build(trials, Shape.from_config(resolve_model("tiny-llama").config), False, None)
    other = TrialConfig.from_dict(leak["config"]).replace(
        gradient_checkpointing="on" if leak["config"]["gradient_checkpointing"] == "off" else "off")
    assert know.verdict(other)[0] is Verdict.MISMATCHED
    checked = [boundary_key(TrialConfig.from_dict(r["config"])) for r in rows if "boundaries" in r["extra"]]
    assert sorted(checked) == sorted(set(checked)) and len(checked) == len(BATCHINGS)


def test_search_with_a_dataset_probes_every_strategy_and_reports_the_data(tmp_path: Path) -> None:
    """Every strategy through the real probe, in one search (micro-batch 2, accumulation 2), packed
    laid out leaking (LEAKY_ENV): its loss check fails once and its other config is never probed."""
    import yaml

    from autofit.probe.child.batches import LEAKY_ENV
    from autofit.protocol.result import ProbeResult
    from autofit.search.objective import rank_key

    space = tmp_path / "space.yaml"
    space.write_text(SMALL_SPACE)
    proc = run_cli("search", "--model", "tiny-llama", "--device", "cpu", "--space", str(space), "--dataset", str(D1),
                   "--max-length", "96", "--budget", "5m", "--confirm", "0", "--out", str(tmp_path / "runs"), "--json",
                   env={LEAKY_ENV: "1"})
    assert proc.returncode == 0, proc.stderr
    run = Path(json.loads(proc.stdout)["run_dir"])
    rows = [json.loads(line) for line in (run / "trials.jsonl").read_text().splitlines()]
    assert {r["config"]["batching"] for r in rows} == set(BATCHINGS)
    _leak_verdicts(run, rows)
    _check_strategy_figures(tmp_path, [r for r in rows if r["config"]["batching"] != "packed"])
    best = json.loads((run / "best.json").read_text())
    fits = [ProbeResult.from_dict(r) for r in rows if r["outcome"] == "fit"]
    assert best["tokens_per_s"] == max(fits, key=rank_key).tokens_per_s  # a noisy fit measured once ranks after
    assert yaml.safe_load((run / "spec.yaml").read_text())["dataset"]["path"] == str(D1)
    report = (run / "report.md").read_text()
    values = np.array(json.loads(next((run / "data").glob("lengths-*.json")).read_text())["lengths"])
    lost = np.clip(values - 96, 0, None).sum() / values.sum()
    assert f"Winner's max_length 96: {lost:.2%} of tokens lost" in report
    assert "![lengths](data/lengths.png)" in report and (run / "data" / "lengths.png").is_file()
    assert "| pad_longest" in report and "| padding_free" in report  # a row each, the winner's marked (winner)


# ----------------------------------------------------------------------------- regress with the stored dataset


def test_regress_re_measures_on_the_stored_dataset(tmp_path: Path) -> None:
    run, _ = moved_run(tmp_path)
    proc = run_cli("regress", str(run), "--json", str(tmp_path / "r.json"))
    assert proc.returncode in (0, 1), proc.stderr  # measured: against a written baseline, either verdict
    (check,) = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert check["outcome"] == "fit" and check["tokens_per_s"] > 0
    assert list((run / "data").glob("standin-bpe-*.json"))  # the probe tokenized the run's dataset
