"""The command line and the search session's decisions (new / resume / join), in-process."""

from __future__ import annotations

import io
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from autofit.cli import build_parser, main
from autofit.cli.search import Progress, request
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.protocol.request import MAX_PROBE_ACCUMULATION, TIMED_STEPS, WARMUP_STEPS
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.rundir import ProbeSettings, RunDir, RunSpec, load_spec, read_spec, write_spec
from autofit.run.session import (
    Mode,
    SearchRequest,
    check_storage,
    open_run_study,
    plan,
    space_dimensions,
    start,
)
from autofit.search.driver import Event, EventKind, open_study

COMMANDS = ("search", "export", "regress", "report", "env", "probe")
WITH_EXIT_CODES = ("search", "report", "env", "probe", "export", "regress")


def search_plan(tmp_path: Path, *flags: str):
    args = build_parser().parse_args(["search", *flags, "--out", str(tmp_path / "runs")])
    return plan(request(args))


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-llama", "--budget", "soon"], "--budget: cannot read 'soon'"),
    (["--model", "tiny-llama", "--max-length", "long"], "--max-length: 'long' is not a positive integer"),
    (["--model", "tiny-llama", "--space", "nosuchspace"], "--space: no such file nosuchspace"),
    (["--resume", "/nonexistent/run"], "--resume: no such folder"),
    (["--space", "cpu-demo"], "--model is required"),
    (["--model", "tiny-llama", "--gpu", "3"], "--gpu: GPU 3 does not exist"),
    (["--model", "tiny-llama", "--confirm", "-1"], "--confirm: -1 is negative"),
    (["--model", "tiny-llama", "--warmup-steps", "1"], f"--warmup-steps: at least {WARMUP_STEPS}"),
    (["--model", "tiny-llama", "--global-batch", "-4"], "--global-batch: '-4' is not a positive integer"),
])
def test_bad_search_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                 message: str) -> None:
    code = main(["search", *args, "--device", "cpu", "--out", str(tmp_path)]
                if "--gpu" not in args else ["search", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert not any(tmp_path.iterdir())  # nothing created


@pytest.mark.parametrize("command", ["search", "plan"])
def test_list_flags_take_their_values_spaced_or_as_a_comma_list(command: str) -> None:
    """`autofit data --max-length 1024 2048` worked; `plan` and `search` said "unrecognized arguments: 2048"."""
    parser = build_parser()
    for argv in (["--max-length", "512", "4096"], ["--max-length", "512,4096"], ["--max-length", "512,", "4096"]):
        args = parser.parse_args([command, "--model", "tiny-llama", *argv, "--global-batch", "8", "16"])
        assert (args.max_length, args.global_batch) == ("512,4096", "8,16"), argv
    assert parser.parse_args([command, "--model", "x", "--global-batch", "-4"]).global_batch == "-4"  # its check's


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as e:
        search_plan(tmp_path, "--model", "nosuch", "--budget", "soon", "--memory-limit", "24", "--device", "cpu")
    assert [p.split(":")[0] for p in e.value.problems] == ["--model", "--memory-limit", "--budget"]


def test_help_ends_with_examples_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0
        assert "examples:" in out, cmd
        assert "exit codes:" in out or cmd not in WITH_EXIT_CODES, cmd
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "130 "):
        assert f" {code}" in top.split("exit codes:")[1], code


def test_probe_flags_are_declared_once_with_the_protocol_defaults() -> None:
    for cmd in ("probe", "search"):
        args = build_parser().parse_args([cmd, "--model", "tiny-llama"])
        assert (args.warmup_steps, args.timed_steps, args.max_probe_accumulation) == \
            (WARMUP_STEPS, TIMED_STEPS, MAX_PROBE_ACCUMULATION), cmd
    args = build_parser().parse_args(["search", "--timed-steps", "7", "--max-probe-accumulation", "0",
                                      "--probe-timeout", "30", "--confirm", "2"])
    assert request(args).probe == ProbeSettings(warmup_steps=WARMUP_STEPS, timed_steps=7,
                                                max_probe_accumulation=None, timeout_s=30.0, confirm=2)


@pytest.mark.parametrize(("cmd", "flag"), [("probe", "--timeout"), ("search", "--probe-timeout")])
def test_a_timeout_of_zero_names_the_flag_the_command_has(cmd: str, flag: str) -> None:
    from autofit.cli.common import check_shared_flags

    for value in ("0", "nan", "inf"):  # nan passed a `<= 0` check, and no probe ever timed out
        with pytest.raises(UsageError, match=f"^{flag}: give a positive, finite number of seconds"):
            check_shared_flags(build_parser().parse_args([cmd, "--model", "tiny-llama", f"{flag}={value}"]))


@pytest.mark.parametrize(("flags", "message"), [
    (["--seed=-1"], "--seed: -1 is not from 0 to 4294967295"),  # a ValueError traceback from the sampler
    (["--seed", str(2**32)], "--seed: 4294967296 is not from 0"),
    (["--standby=-1"], "--standby: -1 is not from 0 to 8"),  # accepted
    (["--standby", "1000000"], "--standby: 1000000 is not from 0 to 8"),  # a million processes importing torch
    (["--storage", "s.journal", "--study-name", ""], "--study-name: an empty value"),
    (["--out", ""], "--out: an empty value; give a folder"),  # run folders went into the current folder
])
def test_numbers_and_names_at_their_extremes_are_refused(flags: list[str], message: str) -> None:
    from autofit.cli.common import check_shared_flags

    with pytest.raises(UsageError, match=f"^{message}"):
        check_shared_flags(build_parser().parse_args(["search", "--model", "tiny-llama", *flags]))


@pytest.mark.parametrize(("argv", "message"), [
    (["export", "RUN", "-o", ""], "-o/--output: an empty value"),  # printed the recipe to stdout, wrote no file
    (["regress", "RUN", "--junit", ""], "--junit: an empty value"),  # CI's --junit "$UNSET": no report, exit 0
    (["regress", "RUN", "--json", ""], "--json: an empty value"),
    (["search", "--model", "tiny-llama", "--gpu", ""], "--gpu: an empty value"),  # read as GPU 0
    # without --dataset they were dropped, the search on random tokens
    (["search", "--model", "tiny-llama", "--text-field", "body"], "--text-field: read the rows of --dataset"),
    (["probe", "--model", "tiny-llama", "--messages-field", "m", "--text-mode", "lines"],
     "--messages-field and --text-mode: read the rows of --dataset"),
])
def test_an_empty_file_or_gpu_and_data_flags_without_data_are_refused(argv: list[str], message: str) -> None:
    from autofit.cli.common import check_shared_flags

    with pytest.raises(UsageError, match=f"^{message}"):
        check_shared_flags(build_parser().parse_args(argv))


def test_a_value_that_starts_with_a_dash_reaches_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "--model", "tiny-llama", "--budget", "-5m", "--out", str(tmp_path)]) == 2
    assert "--budget: '-5m' is not positive" in capsys.readouterr().err


def test_a_budget_under_a_second_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.001s was taken, shown as "budget 0s", and made a run folder that said only "Nothing was probed"."""
    assert main(["search", "--model", "tiny-llama", "--budget", "0.001s", "--out", str(tmp_path)]) == 2
    assert "--budget: '0.001s' is under a second" in capsys.readouterr().err and not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the session's decisions


def test_max_length_and_global_batch_replace_the_space(tmp_path: Path) -> None:
    plain = search_plan(tmp_path, "--model", "tiny-llama", "--space", "cpu-demo", "--device", "cpu")
    session = search_plan(tmp_path, "--model", "tiny-llama", "--space", "cpu-demo", "--device", "cpu",
                          "--max-length", "256,128", "--global-batch", "8")
    space = session.spec.space
    assert space.lengths == [256, 128] and plain.spec.space.lengths != [256, 128]
    assert space.fixed["global_batch"] == 8 and "global_batch" not in space.dimensions
    assert {c.global_batch for c in space.candidates()} == {8}
    several = search_plan(tmp_path, "--model", "tiny-llama", "--space", "cpu-demo", "--device", "cpu",
                          "--global-batch", "8,16")
    assert several.spec.space.dimensions["global_batch"] == [8, 16]
    assert not (tmp_path / "runs").exists()  # plan creates nothing


def test_space_dimensions_reject_what_is_not_a_positive_list() -> None:
    assert space_dimensions("4096,2048", None) == {"max_length": [4096, 2048]}
    for text in ("0", "1,,2", "x", "-3", ""):
        with pytest.raises(UsageError, match="--global-batch"):
            space_dimensions(None, text)


def test_a_new_search_keeps_its_study_in_the_run_folder(tmp_path: Path) -> None:
    session = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--seed", "3")
    assert session.mode is Mode.NEW and session.local_storage
    assert session.run_dir.parent == tmp_path / "runs"
    assert session.spec.storage == f"sqlite:///{RunDir(session.run_dir).study_db.resolve()}"
    assert session.spec.seed == 3 and session.spec.budget_s == 1800.0
    assert RunDir(session.run_dir).default_storage(2).endswith("study.journal")


def test_resume_reads_the_spec_and_overrides_only_what_was_given(tmp_path: Path) -> None:
    session = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--budget", "2m")
    write_spec(session.run_dir, session.spec)
    resumed = plan(SearchRequest(resume=session.run_dir))
    assert resumed.mode is Mode.RESUME and resumed.spec == session.spec and resumed.local_storage
    longer = plan(SearchRequest(resume=session.run_dir, budget="5m", device="cpu"))
    assert longer.spec.budget_s == 300.0 and longer.spec.replace(budget_s=120.0) == session.spec


def test_resume_refuses_another_memory_than_the_run_was_judged_against(tmp_path: Path) -> None:
    """Fits and out-of-memory results hold for the limit and headroom they were judged against: a resumed search
    under a smaller --memory-limit kept a winner of 269 MiB as the best "of 100 MiB", and --memory-limit without
    --device was dropped without a word."""
    session = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--memory-limit", "1GiB")
    write_spec(session.run_dir, session.spec)
    for asked in ({"memory_limit": "100MiB"}, {"memory_limit": "100MiB", "device": "cpu"}, {"headroom": 0.1}):
        with pytest.raises(UsageError) as e:
            plan(SearchRequest(resume=session.run_dir, **asked))  # type: ignore[arg-type]
        assert str(e.value).startswith("--resume: this run was measured under 1 GiB with 5% headroom"), asked
    for same in ({"device": "cpu", "memory_limit": "1GiB"}, {"device": "cpu"}):  # the run's limit, kept
        resumed = plan(SearchRequest(resume=session.run_dir, **same))  # type: ignore[arg-type]
        assert resumed.spec == session.spec and resumed.notes == ()
    kept = plan(SearchRequest(resume=session.run_dir, seed=3, policy="promise", out=tmp_path / "elsewhere"))
    assert kept.spec == session.spec  # the run's own seed, policy and folder
    assert kept.notes == ("--resume continues the run as it was planned (the study measured that model and "
                          "space): --seed, --policy, --out ignored; start a new search to change them.",)


def test_resume_names_the_probe_flags_it_ignores_as_given(tmp_path: Path) -> None:
    """It said '--probe-timeout, --confirm and the probe's step counts ignored' for --train-tokens alone, naming
    flags not given and not the one that was."""
    session = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu")
    write_spec(session.run_dir, session.spec)
    resumed = plan(SearchRequest(resume=session.run_dir, probe=replace(ProbeSettings(), train_tokens=1000,
                                                                        timed_steps=TIMED_STEPS + 1)))
    assert resumed.notes == ("--resume continues the run as it was planned (the study measured that model and "
                             "space): --timed-steps, --train-tokens ignored; start a new search to change them.",)


def test_resume_says_which_flags_it_cannot_change(tmp_path: Path) -> None:
    session = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu")
    write_spec(session.run_dir, session.spec)
    assert plan(SearchRequest(resume=session.run_dir)).notes == ()
    resumed = plan(SearchRequest(resume=session.run_dir, model="llama2-7b", space="qlora", max_length="128",
                                 study_name="other"))
    assert resumed.spec == session.spec
    assert resumed.notes == ("--resume continues the run as it was planned (the study measured that model and "
                             "space): --model, --space, --max-length, --study-name ignored; start a new search to "
                             "change them.",)


def test_joining_a_study_says_which_flags_it_ignores_and_refuses_a_foreign_study(tmp_path: Path) -> None:
    import optuna

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    first = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--storage", storage,
                        "--study-name", "s")
    start(first)
    joined = plan(SearchRequest(model="llama2-7b", space="qlora", device="cpu", storage=storage, study_name="s",
                                out=tmp_path / "runs", budget="2m"))
    assert joined.spec.model == first.spec.model and joined.spec.budget_s == 120.0
    assert joined.notes == ("joining the study searches its own model and space: --model, --space ignored; start "
                            "a new search to change them.",)
    foreign = optuna.create_study(storage=storage, study_name="theirs")
    foreign.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(UsageError, match=r"--study-name: the study 'theirs' .* was not made by autofit"):
        plan(SearchRequest(model="tiny-llama", device="cpu", storage=storage, study_name="theirs", out=tmp_path))


def test_two_searches_planned_in_the_same_second_get_two_folders(tmp_path: Path) -> None:
    first = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu")
    second = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--space", "cpu-demo")
    # the same second: the same id, folder and study
    second = replace(second, run_dir=first.run_dir, spec=second.spec.replace(
        run_id=first.spec.run_id, study_name=first.spec.study_name, storage=first.spec.storage))
    a, study_a = start(first)
    b, study_b = start(second)
    assert a.run_dir == first.run_dir and b.run_dir == first.run_dir.with_name(first.run_dir.name + "-2")
    assert b.spec.run_id == a.spec.run_id + "-2" and b.spec.study_name == a.spec.study_name + "-2"
    assert b.spec.storage == f"sqlite:///{RunDir(b.run_dir).study_db.resolve()}"
    assert load_spec(a.run_dir).space.name == "lora" and load_spec(b.run_dir).space.name == "cpu-demo"
    assert study_a.study_name != study_b.study_name


def test_a_copied_run_folder_uses_its_own_study(tmp_path: Path) -> None:
    session, _ = start(search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu"))
    copy = tmp_path / "copy" / session.run_dir.name
    shutil.copytree(session.run_dir, copy)
    assert load_spec(copy).storage == f"sqlite:///{RunDir(copy).study_db.resolve()}"
    assert load_spec(session.run_dir).storage == session.spec.storage
    (copy / "study.db").unlink()  # without a study file of its own: still its own, never the original's
    assert load_spec(copy).storage == f"sqlite:///{RunDir(copy).study_db.resolve()}"
    with pytest.raises(UsageError, match="study.db is missing"):
        open_run_study(copy)


def test_a_study_at_the_storage_is_joined_with_its_own_spec(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    first = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--storage", storage,
                        "--study-name", "s1", "--max-length", "128")
    assert first.mode is Mode.NEW and not first.local_storage and first.spec.storage == storage
    open_study(storage, "s1", create=True, seed=0).set_user_attr("spec", first.spec.to_dict())
    joined = plan(SearchRequest(model="llama2-7b", storage=storage, study_name="s1", device="cpu",
                                out=tmp_path / "runs", worker="host2"))
    assert joined.mode is Mode.JOIN and not joined.local_storage
    assert joined.spec.model.ref == "tiny-llama" and joined.spec.space.lengths == [128]
    assert joined.spec.run_id == f"{first.spec.run_id}-worker-host2"
    assert joined.run_dir == tmp_path / "runs" / joined.spec.run_id


@pytest.mark.parametrize("url, message", [
    ("foo://bar", "is not a storage autofit can open"),
    ("sqlite:////nonexistent/dir/x.db", "the folder /nonexistent/dir"),
    ("/nonexistent/dir/s.journal", "the folder /nonexistent/dir"),
    ("sqlite://", "is not an SQLite URL"),
    ("sqlite:///:memory:", "in memory"),
])
def test_a_storage_that_cannot_work_is_refused(url: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_storage(url)


def test_storages_that_can_work_pass(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path}/x.db", str(tmp_path / "s.journal"),
                "postgresql+psycopg://user:pw@db.invalid/autofit"):
        check_storage(url)  # a server that is down is found when the study opens


# ----------------------------------------------------------------------------- the run folder


def test_run_spec_round_trips_through_spec_yaml(tmp_path: Path) -> None:
    spec = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--memory-limit", "90MiB").spec
    assert RunSpec.from_dict(spec.to_dict()) == spec
    write_spec(tmp_path / "run", spec)
    # the planned study file was never made: the folder the spec is in holds the run's study
    moved = spec.replace(storage=f"sqlite:///{(tmp_path / 'run' / 'study.db').resolve()}")
    assert load_spec(tmp_path / "run") == moved
    assert read_spec(tmp_path / "run") == moved.to_dict()
    assert spec.to_dict()["created"] == spec.run_id.split("-")[0]


def test_a_cut_spec_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text("model: {kind: preset}\nspace: {}\n")
    with pytest.raises(UsageError, match=r"--resume: .*spec.yaml is not a complete autofit run spec"):
        load_spec(tmp_path, "--resume")


def test_report_of_a_run_without_its_study_is_a_usage_error(tmp_path: Path) -> None:
    spec = search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu").spec
    run = tmp_path / "run"
    write_spec(run, spec.replace(storage=f"sqlite:///{run / 'study.db'}"))
    with pytest.raises(UsageError, match="study.db is missing"):
        open_run_study(run)


# ----------------------------------------------------------------------------- the live table


@pytest.mark.parametrize("width", [80, 140])
def test_the_live_table_keeps_one_line_a_row_at_the_terminal_width(width: int) -> None:
    progress = Progress(enabled=True)
    progress.console = Console(width=width, record=True, highlight=False, file=io.StringIO())
    progress.workers = {"cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200"}
    long = "L=4096 mb=16 ga=1 bf16 ckpt=every_2+offload nf4 paged_adamw_8bit flash_attention_2 expandable"
    progress.rows = [(str(n), long, "skip: duplicate", "123,456", "139.2 GiB", "140.1 GiB", "cuda:1 NVIDIA H200")
                     for n in range(1, 4)]
    progress.console.print(progress._table())
    lines = [x for x in progress.console.export_text().splitlines() if x.strip()]
    assert all(len(x.rstrip()) <= width for x in lines), lines
    rows = [x for x in lines if "skip: duplicate" in x]
    assert len(rows) == 3, lines  # each row on one line: nothing wrapped onto a second
    assert all("123,456" in x and "139.2 GiB" in x for x in rows)
    assert ("140.1 GiB" in rows[0]) == (width >= 110)  # the predicted peak only where there is room


def test_a_repeat_line_shows_its_own_figure_and_the_median(capsys: pytest.CaptureFixture[str]) -> None:
    """The tok/s column of a repeat is what that process measured; the median the config now ranks by is
    named beside it (a user read the median as the repeat's figure)."""
    cfg = TrialConfig.from_mapping({"micro_batch_size": 2})
    merged = ProbeResult(Outcome.FIT, cfg.to_dict(), tokens_per_s=9876.0, peak_memory_bytes=150 * 2**20,
                         extra={"measurements": [10196.9, 9555.2]})
    progress = Progress(enabled=True, budget_s=60)
    progress.tty = False
    progress(Event(2, "cpu", cfg.to_dict(), EventKind.AGAIN, merged, None, merged, 7.0))
    line = capsys.readouterr().out
    assert "fit (again; median 9,876)" in line and "9,555 tok/s" in line and "10,197" not in line, line


def test_a_repeat_that_did_not_finish_is_shown_as_it_ended(capsys: pytest.CaptureFixture[str]) -> None:
    from autofit.search.driver import repeat_shown

    cfg = TrialConfig.from_mapping({"micro_batch_size": 2})
    first = ProbeResult(Outcome.FIT, cfg.to_dict(), tokens_per_s=16349.0, extra={"measurements": [16349.0]})
    cut = ProbeResult(Outcome.TIMEOUT, cfg.to_dict(), reason="stopped at the budget's end")
    shown = repeat_shown(first, cut)
    progress = Progress(enabled=True, budget_s=60)
    progress.tty = False
    progress(Event(1, "cpu", cfg.to_dict(), EventKind.AGAIN, shown, None, first, 0.0))
    line = capsys.readouterr().out
    assert "timeout (again)" in line and "16,349" not in line.split("timeout")[1].split("peak")[0], line
    assert repeat_shown(first, first) is first


@pytest.mark.parametrize(("flags", "fields"), [
    ([], ("text", "messages")),
    (["--text-field", "body"], ("body", "")),  # alone: a row's default 'messages' chat no longer wins over it
    (["--text-field", "body", "--messages-field", "conv"], ("body", "conv")),
    (["--messages-field", "conv"], ("text", "conv")),
])
def test_text_field_given_alone_reads_text_only(flags: list[str], fields: tuple[str, str]) -> None:
    from autofit.cli.common import data_fields

    for cmd in (["data", "d.jsonl"], ["search"], ["probe"]):
        assert data_fields(build_parser().parse_args([*cmd, "--model", "tiny-llama", *flags])) == fields


def test_headroom_takes_a_percentage_as_tolerance_does(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["search", "--model", "tiny-llama", "--headroom", "5%"]).headroom == pytest.approx(0.05)
    assert parse(["search", "--model", "tiny-llama", "--headroom", "0.1"]).headroom == pytest.approx(0.1)
    with pytest.raises(SystemExit) as e:  # argparse's own exit for a value its type refuses
        main(["search", "--model", "tiny-llama", "--headroom", "5x"])
    assert e.value.code == 2
    assert "--headroom: '5x' is not a share; give for example 5% or 0.05" in capsys.readouterr().err


def test_a_relative_storage_is_kept_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec kept `sqlite:///rel.db` as typed: `report` from another folder made an empty rel.db there and
    said the study was gone."""
    monkeypatch.chdir(tmp_path)
    for given, want in (("sqlite:///rel.db", f"sqlite:///{tmp_path / 'rel.db'}"),
                        ("rel.journal", str(tmp_path / "rel.journal"))):
        assert search_plan(tmp_path, "--model", "tiny-llama", "--device", "cpu", "--storage", given,
                           "--study-name", "s").spec.storage == want


def test_a_search_of_lora_targets_the_model_lacks_is_refused_before_it_starts(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=4).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UsageError, match=r"^--space cpu-demo: .* \(gpt2\) has no module q_proj, v_proj"):
        search_plan(tmp_path, "--model", str(tmp_path / "gpt2" / "config.json"), "--space", "cpu-demo",
                    "--device", "cpu", "--max-length", "64")
    assert not (tmp_path / "runs").exists()  # nothing made
