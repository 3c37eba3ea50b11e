"""What one optimizer step trained, in report.md and best.json: the winner's and the padded baseline's samples
and trained tokens per step as the probes measured them, and a winner off the global batch marked as changing
what is learned (issue 29)."""

from __future__ import annotations

import json
from pathlib import Path

from autofit.config.space import Space
from autofit.config.spec import TrialConfig
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.markdown import learning_changes
from autofit.run.report.outputs import write_outputs
from autofit.run.rundir import load_spec
from runs import data_run

MIB = 2**20


def _row(trial: int, batching: str, tokens_per_s: float, step: dict[str, object], micro_batch_size: int = 2,
         noisy: bool = False) -> dict[str, object]:
    cfg = TrialConfig(max_length=96, micro_batch_size=micro_batch_size, global_batch=16, batching=batching,
                      precision="fp32")
    res = ProbeResult(Outcome.FIT, cfg, device="cpu", tokens_per_s=tokens_per_s, peak_memory_bytes=100 * MIB,
                      extra={"pad_fraction": 0.0, **step}, noisy=noisy)
    return {"trial": trial, **res.to_dict()}


def _with_data(run: Path, **data: object) -> Path:
    (run / "data").mkdir()  # what a search with --dataset writes first: the data's lengths
    (run / "data" / "data.json").write_text(json.dumps({
        "dataset": {"path": "d1.jsonl", "content_hash": "0" * 64}, "samples": 200, "tokens": 11_640, "mean": 58.2,
        "percentiles": {"p50": 41, "p99": 301}, "cuts": [], **data}))
    return run


def _write(tmp_path: Path, winner_step: dict[str, object], **data: object) -> tuple[dict, str]:
    run = _with_data(data_run(tmp_path, "packed"), **data)
    rows = [_row(0, "pad_longest", 900.0, {"gradient_accumulation_steps": 8, "samples_per_step": 16,
                                           "trained_tokens_per_step": 930.4, "keeps_global_batch": True}),
            _row(1, "group_by_length", 1100.0, {"gradient_accumulation_steps": 8, "samples_per_step": 16,
                                                "trained_tokens_per_step": 930.4, "keeps_global_batch": True}),
            _row(2, "packed", 3000.0, winner_step)]
    best = write_outputs(run, load_spec(run), rows, [(1.0, 3000.0)])
    assert best is not None
    return json.loads((run / "best.json").read_text()), (run / "report.md").read_text()


def test_best_json_and_the_report_give_the_winner_s_and_the_baseline_s_step(tmp_path: Path) -> None:
    best, report = _write(tmp_path, {"gradient_accumulation_steps": 1, "samples_per_step": 15.2,
                                     "trained_tokens_per_step": 884.0, "keeps_global_batch": True})
    assert best["step"] == {"gradient_accumulation_steps": 1, "samples_per_step": 15.2,
                            "trained_tokens_per_step": 884.0, "keeps_global_batch": True, "global_batch": 16}
    # the baseline is the fastest padded strategy measured: group_by_length here, not pad_longest
    assert best["baseline"]["config"]["batching"] == "group_by_length"
    assert best["baseline"]["step"]["samples_per_step"] == 16
    assert best["baseline"]["step"]["trained_tokens_per_step"] == 930.4
    assert not any(c.startswith("samples_per_step=") for c in best["learning_changes"])
    assert "| samples per optimizer step | `15.2` |" in report
    assert "| trained tokens per optimizer step | `884` |" in report
    assert "| packed (winner) | 3,000 |" in report and "| group_by_length (baseline) | 1,100 |" in report
    assert "| 15.2 | 884 |" in report and "| 16 | 930 |" in report
    assert "effective batch" not in report  # the old line said 16 sequences, whatever the step trained


def test_a_winner_off_the_global_batch_is_marked_as_changing_what_is_learned(tmp_path: Path) -> None:
    best, report = _write(tmp_path, {"gradient_accumulation_steps": 1, "samples_per_step": 40.0,
                                     "trained_tokens_per_step": 2300.0, "keeps_global_batch": False})
    assert best["step"]["keeps_global_batch"] is False
    assert "samples_per_step=40 (global_batch=16)" in best["learning_changes"]
    assert "| samples per optimizer step | `40` (**changes what is learned**: the global batch is 16) |" in report
    assert "| 40 (off the global batch) | 2,300 |" in report


def test_without_step_figures_the_config_s_step_is_given(tmp_path: Path) -> None:
    """A result stored before probes reported their step (or random tokens): the config's accumulation and
    effective batch, no trained tokens."""
    best, report = _write(tmp_path, {})
    assert best["step"] == {"gradient_accumulation_steps": 8, "samples_per_step": 16,
                            "trained_tokens_per_step": None, "keeps_global_batch": True, "global_batch": 16}
    assert "| samples per optimizer step | `16` |" in report and "trained tokens per optimizer step" not in report


def test_the_data_section_says_what_the_search_skipped_and_a_cut_of_nothing_changes_nothing(tmp_path: Path) -> None:
    step = {"gradient_accumulation_steps": 1, "samples_per_step": 16, "trained_tokens_per_step": 930.0,
            "keeps_global_batch": True}
    _, report = _write(tmp_path / "a", step, cuts=[{"max_length": 96, "tokens_lost": 0.0, "samples_truncated": 0.0}],
                       bad_rows={"count": 20, "counts": {"not JSON": 5, "missing 'text'": 15}})
    assert "- **20 rows skipped** (5 not JSON, 15 missing 'text'): the search measured the rest" in report
    assert "0.00% of samples truncated**." in report and "truncated** (it changes" not in report
    _, report = _write(tmp_path / "b", step, cuts=[{"max_length": 96, "tokens_lost": 0.05,
                                                    "samples_truncated": 0.1}])
    assert "10.00% of samples truncated** (it changes what is learned)." in report and "rows skipped" not in report


def test_only_values_that_train_otherwise_than_the_user_s_setup_are_marked() -> None:
    """A winner at the defaults (bf16, no quantization, AdamW fused or not) and at the longest length the space
    allows trains as the user's setup does: nothing is marked. Once the report marked `quantization none` and
    `optimizer adamw_torch_fused` as changing what is learned, whatever the winner's values."""
    space = Space("t", fixed={}, dimensions={"max_length": [1024, 2048], "micro_batch_size": [1, 2]})
    plain = TrialConfig(max_length=2048, optimizer="adamw_torch")  # unfused: the same update as the default
    assert learning_changes(plain, space=space) == []
    changed = TrialConfig(max_length=1024, precision="fp16", quantization="nf4", optimizer="paged_adamw_8bit")
    assert learning_changes(changed, space=space) == ["max_length=1024", "precision=fp16", "quantization=nf4",
                                                      "optimizer=paged_adamw_8bit"]
    # a search of one length, the user's: that length changes nothing
    assert learning_changes(TrialConfig(max_length=1024), space=Space("u", {"max_length": 1024}, {})) == []
    assert learning_changes(TrialConfig(max_length=1024)) == ["max_length=1024"]  # no space: the default's 2048


def test_the_report_marks_the_winner_s_changed_settings_only(tmp_path: Path) -> None:
    best, report = _write(tmp_path, {"gradient_accumulation_steps": 1, "samples_per_step": 15.2,
                                     "trained_tokens_per_step": 884.0, "keeps_global_batch": True})
    # the rows' length 96 against the 128 the run's space allows, their fp32 against the default bf16
    assert best["learning_changes"] == ["max_length=96", "precision=fp32"]
    assert "| max_length | `96` (changes what is learned) |" in report
    assert "| precision | `fp32` (changes what is learned) |" in report
    assert "| quantization | `none` |" in report and "| optimizer | `adamw_torch_fused` |" in report


def test_on_the_cpu_the_memory_section_claims_no_measured_term_and_with_nothing_measured_there_is_none(
        tmp_path: Path) -> None:
    """The section said activations and overhead were measured, but on the CPU every term is the model's (the
    probe measures the process's added memory only); a report with no probe had an empty section."""
    _, report = _write(tmp_path / "a", {})
    memory = report.split("## Where the memory goes", 1)[1].split("\n## ", 1)[0]
    assert "On the CPU none is measured" in memory and "are measured where" not in memory
    run = data_run(tmp_path / "b", "packed")
    write_outputs(run, load_spec(run), [], [], "budget spent")
    report = (run / "report.md").read_text()
    assert "## Where the memory goes" not in report and "## Nothing measured" in report


def test_a_baseline_at_other_settings_than_the_winner_s_is_said_not_to_be_the_batching_s_speed_up(
        tmp_path: Path) -> None:
    """The table credited padding_free with 16.9x over a pad_longest baseline at micro-batch 1 (0% padding): the
    gap was the micro-batch's. The report says so, and gives the padded strategy at the winner's settings."""
    run = _with_data(data_run(tmp_path, "padding_free"))
    step = {"gradient_accumulation_steps": 8, "samples_per_step": 16, "keeps_global_batch": True}
    rows = [_row(0, "pad_longest", 83.0, step, micro_batch_size=1, noisy=True),
            _row(1, "padding_free", 1401.0, step, micro_batch_size=8, noisy=True)]
    write_outputs(run, load_spec(run), rows, [(1.0, 1401.0)])
    report = (run / "report.md").read_text()
    assert "| padding_free (winner) | 1,401 (noisy, measured once) | 1.00x |" in report
    assert "| pad_longest (baseline) | 83 (noisy, measured once) | 16.88x |" in report
    assert ("The winner also differs from the baseline in micro_batch_size 8 against 1: the speed-up is not the "
            "batching's alone; a padded strategy at the winner's other settings was not measured.") in report
    rows.append(_row(2, "group_by_length", 700.0, step, micro_batch_size=8, noisy=True))
    write_outputs(run, load_spec(run), rows, [(1.0, 1401.0)])
    report = (run / "report.md").read_text()
    assert "group_by_length (baseline) | 700 (noisy, measured once) | 2.00x" in report  # now the like-for-like one
    assert "The winner and the baseline differ in batching alone: the speed-up is the batching's." in report
    rows[0] = _row(0, "pad_longest", 800.0, step, micro_batch_size=1, noisy=True)  # faster, at micro-batch 1
    write_outputs(run, load_spec(run), rows, [(1.0, 1401.0)])
    assert ("micro_batch_size 8 against 1: the speed-up is not the batching's alone; at the winner's other settings, "
            "group_by_length gave 700 trained tokens/s (the winner 2.00x).") in (run / "report.md").read_text()
