"""`autofit regress`: the judging, JUnit, history and re-baselining logic in-process; re-probes for real
against an edited or unchanged baseline end to end (marked slow; CPU tolerances)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DATA_DIR
from faults import full_disk, read_only_folder

from autofit.cli import main
from autofit.config.target import Target
from autofit.core import envinfo
from autofit.core.errors import CannotWrite, RegressionFound, UsageError
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run import regress
from autofit.run.best import BestEntry
from autofit.run.regress import Rule, Status, Tolerance
from autofit.run.rundir import target_dict
from runs import BASE, MIB, recorded, write_run

TOL10 = Tolerance(speed=0.10, memory=0.05)


def fit(tokens_per_s: float, peak: int = 100 * MIB) -> ProbeResult:
    return ProbeResult(Outcome.FIT, BASE.config.to_dict(), tokens_per_s=tokens_per_s, peak_memory_bytes=peak)


def failed(outcome: Outcome, peak: int | None = None) -> ProbeResult:
    return ProbeResult(outcome, BASE.config.to_dict(), peak_memory_bytes=peak, reason=f"{outcome.value} here")


def check_of(results: list[ProbeResult], rule: Rule = Rule()) -> regress.Check:
    """check_config with these results as its runs, in order (a first check: no history); it must ask
    for no more than given."""
    asked: list[int] = []

    def measure(attempt: int) -> ProbeResult:
        asked.append(attempt)
        return results[attempt - 1]

    check = regress.check_config(BASE, measure, TOL10, rule)
    assert asked == list(range(1, check.attempts + 1))
    return check


# --------------------------------------------------------------------------- judging, in-process


@pytest.mark.parametrize(
    "results, raw, status, attempts, tokens_per_s, peak",
    [
        ([fit(1000)], Status.OK, Status.OK, 1, 1000, 100 * MIB),
        ([fit(950, 104 * MIB)], Status.OK, Status.OK, 1, 950, 104 * MIB),  # inside both tolerances
        ([fit(500), fit(1000), fit(980)], Status.OK, Status.OK, 3, 980, 100 * MIB),  # one slow run is outvoted
        ([fit(500), fit(520), fit(510)], Status.SLOWER, Status.SLOWER, 3, 510, 100 * MIB),  # 49% slower: at once
        ([fit(850), fit(860), fit(855)], Status.SLOWER, Status.SUSPECT, 3, 855, 100 * MIB),  # 14.5%: one check
        ([fit(500), fit(520), fit(1000)], Status.SLOWER, Status.INCONCLUSIVE, 3, 520, 100 * MIB),  # runs 2x apart
        (
            [fit(1000, 120 * MIB), fit(1000, 121 * MIB), fit(1000, 119 * MIB)],
            Status.HEAVIER,
            Status.HEAVIER,
            3,
            1000,
            121 * MIB,
        ),  # the largest peak, 21% heavier: at once
        ([fit(2000), fit(1900), fit(2100)], Status.FASTER, Status.FASTER, 3, 2000, 100 * MIB),
        (
            [fit(500), failed(Outcome.CRASH), fit(1000)],
            Status.SLOWER,
            Status.INCONCLUSIVE,
            3,
            750,
            100 * MIB,
        ),  # a crash is not a run
    ],
)
def test_a_figure_outside_tolerance_is_the_median_of_three_runs(
    results: list[ProbeResult], raw: Status, status: Status, attempts: int, tokens_per_s: float, peak: int
) -> None:
    """`raw`: what the figures alone say; `status`: the verdict of the default rule on a first check."""
    check = check_of(results)
    assert (check.status, check.attempts, check.tokens_per_s, check.peak_bytes) == (
        status,
        attempts,
        tokens_per_s,
        peak,
    )
    fitting = [r.tokens_per_s for r in results if r.outcome.is_fit()]
    assert check.runs == tuple(fitting) and check.tokens_per_s == statistics.median(fitting)
    assert regress.judge(BASE, regress.combine(results), TOL10) is raw
    assert check.failed is (status in (Status.SLOWER, Status.HEAVIER))


@pytest.mark.parametrize(
    "results, attempts",
    [
        ([failed(Outcome.OOM, 130 * MIB)], 1),  # out of memory at once: no second chance
        ([fit(500), failed(Outcome.OOM, 130 * MIB), fit(1000)], 3),  # a repeat out of memory: it does not fit
    ],
)
def test_out_of_memory_is_no_longer_fits(results: list[ProbeResult], attempts: int) -> None:
    check = check_of(results, Rule(consecutive=5, severe=None))  # whatever the rule: no waiting for a streak
    assert check.status is Status.NO_LONGER_FITS and check.failed and check.attempts == attempts
    assert check.outcome == "oom" and check.tokens_per_s is None
    assert check.messages == ("winner no longer fits: outcome oom (oom here); baseline 1,000 tokens/s at 100 MiB",)


def test_the_messages_state_the_figures_and_the_policy() -> None:
    assert check_of([fit(1000)]).messages == (
        (
            "winner: 1,000 tokens/s vs baseline 1,000 (+0.0%, tolerance 10%); peak 100 MiB vs 100 MiB "
            "(+0.0%, tolerance 5%); 1 run"
        ),
    )
    assert check_of([fit(2000), fit(1900), fit(2100)]).messages == (
        (
            "winner: 2,000 tokens/s vs baseline 1,000 (+100.0%, tolerance 10%); peak 100 MiB vs 100 MiB "
            "(+0.0%, tolerance 5%); median of 3 runs (spread 11%)"
        ),
        (
            "winner is faster than its baseline beyond tolerance: re-baseline by running this command again "
            "with --update-baseline"
        ),
    )
    assert check_of([fit(850), fit(860), fit(855)]).messages[1] == (
        "winner is suspect: slower by 14.5%, outside the tolerance (10%) on 1 check in a row; 2 in a row make a "
        "regression (--consecutive), or one check worse than 2 times the tolerance (20%, --severe-factor). Not "
        "failed: the next check decides."
    )
    assert check_of([fit(500), fit(520), fit(1000)]).messages[1] == (  # one scale for both (it gave 100% and 92%)
        "winner is inconclusive: slower by 48.0%, but its runs differ 2.00x among themselves, as much as "
        "tonight's tokens/s differs from the baseline (1.92x): too noisy to judge, and not a regression on this "
        "evidence. Measure again on an idle machine."
    )
    assert check_of([fit(500), fit(520), fit(510)]).messages[1] == (
        "winner is slower by 49.0%, worse than 2 times the tolerance (20%): a regression at once"
    )


def waited(tokens_per_s: float, wait_s: float, cpu_s: float = 1.0) -> ProbeResult:
    """A fit whose three timed steps each waited `wait_s` for a CPU and ran `cpu_s` on one (hostclock)."""
    res = fit(tokens_per_s)
    res.extra = {"host_per_step": {"step_s": [2.0] * 3, "run_wait_s": [wait_s] * 3, "process_cpu_s": [cpu_s] * 3}}
    return res


def test_runs_slower_by_what_their_waits_for_a_cpu_explain_are_inconclusive() -> None:
    """A CPU shared with other jobs: three runs alike at 16% of the baseline, each probe's threads waiting for
    a CPU most of their steps. It was "a regression at once"; the waits say the machine, not the config."""
    assert regress.cpu_wait_slowdown(waited(160, 5.4)) == pytest.approx(6.4)
    busy = check_of([waited(160, 5.4), waited(170, 5.0), waited(165, 5.6)])
    assert busy.status is Status.INCONCLUSIVE and not busy.failed and busy.slowdowns == pytest.approx((6.4, 6, 6.6))
    assert busy.messages[1] == (
        "winner is inconclusive: slower by 83.5%, but its runs waited for a CPU (other processes on this "
        "machine's cores) long enough to run 6.40x slower, as much as tonight's tokens/s differs from the "
        "baseline (6.06x): too noisy to judge, and not a regression on this evidence. Measure again on an idle "
        "machine.")
    assert busy.to_dict()["slowdowns"] == pytest.approx([6.4, 6, 6.6])  # in the history, for a rebuilt verdict
    # waits that explain less than the gap (or none, or no counters: not Linux) leave a regression
    assert check_of([waited(160, 0.5), waited(170, 0.5), waited(165, 0.5)]).status is Status.SLOWER
    assert check_of([waited(160, 0.0), waited(170, 0.0), waited(165, 0.0)]).status is Status.SLOWER
    assert check_of([fit(160), fit(170), fit(165)]).status is Status.SLOWER
    # waiting makes a run slower, never faster: a faster check is faster whatever the waits
    assert check_of([waited(2000, 5.4), waited(2000, 5.4), waited(2000, 5.4)]).status is Status.FASTER


def test_status_marks_and_failures() -> None:
    assert [(s.mark, s.failed(), s.doubtful()) for s in Status] == [
        ("ok", False, False),
        ("FASTER", False, False),
        ("SUSPECT", False, True),
        ("INCONCLUSIVE", False, True),
        ("SLOWER", True, False),
        ("HEAVIER", True, False),
        ("NO LONGER FITS", True, False),
    ]


# --------------------------------------------------------------------------- the rule over a history, in-process

NIGHTS = DATA_DIR / "regress-history-nights.jsonl"
"""Eleven nightly checks of one winner on an H200 (tolerances 7% and 3%): a noisy night, a slowdown over two
nights, a recovery, a single bad night, a slowdown beyond twice the tolerance, a heavier peak."""


def replay(records: list[dict[str, Any]], rule: Rule) -> list[str]:
    """Each night's verdict from its own runs and the nights before it."""
    out = []
    for i, entry in enumerate(records):
        base, tonight = recorded(entry["checks"][0])
        out.append(regress.decide(base, records[:i], tonight, Tolerance(0.07, 0.03), rule).status.value)
    return out


def test_the_recorded_nights_follow_the_rule(tmp_path: Path) -> None:
    shutil.copyfile(NIGHTS, tmp_path / regress.HISTORY)
    records = regress.read_history(tmp_path)
    gpu = replay(records, Rule(memory_exact=True))
    assert gpu == ["ok", "inconclusive", "ok", "suspect", "slower", "ok", "suspect", "ok", "slower", "heavier", "ok"]
    assert gpu == [r["checks"][0]["status"] for r in records]  # as regress recorded them
    # the same nights judged as on the CPU: a peak 4% over waits for a second night like speed
    assert replay(records, Rule(memory_exact=False))[9] == "suspect"
    # the old rule (every check outside fails): the noisy night is still no regression, the single bad night is
    assert replay(records, Rule(consecutive=1)) == [
        "ok",
        "inconclusive",
        "ok",
        "slower",
        "slower",
        "ok",
        "slower",
        "ok",
        "slower",
        "heavier",
        "ok",
    ]
    # three in a row, never at once: the slowdown of two nights and the sharp one are suspect
    assert replay(records, Rule(consecutive=3, severe=None)) == [
        "ok",
        "inconclusive",
        "ok",
        "suspect",
        "suspect",
        "ok",
        "suspect",
        "ok",
        "suspect",
        "suspect",
        "ok",
    ]


def night(*tokens_per_s: float, peak: int = 100 * MIB, base: BestEntry = BASE) -> dict[str, Any]:
    """A history record of one check of `base` with these runs."""
    return {
        "date": "2026-03-01T03:00:00+00:00",
        "checks": [regress.settle(base, [fit(t, peak) for t in tokens_per_s], TOL10).to_dict()],
    }


def verdict_of(
    history: list[dict[str, Any]],
    *tokens_per_s: float,
    rule: Rule = Rule(),
    peak: int = 100 * MIB,
    base: BestEntry = BASE,
) -> regress.Verdict:
    return regress.decide(base, history, regress.combine([fit(t, peak) for t in tokens_per_s]), TOL10, rule)


@pytest.mark.parametrize(
    "history, runs, rule, status, streak",
    [
        ([], (850, 860, 855), Rule(), Status.SUSPECT, 1),
        ([night(850, 860, 855)], (850, 860, 855), Rule(), Status.SLOWER, 2),  # two in a row
        ([night(850, 860, 855), night(1000)], (850, 860, 855), Rule(), Status.SUSPECT, 1),  # a recovery between
        ([night(500, 520, 1000)], (850, 860, 855), Rule(), Status.SLOWER, 2),  # a noisy night outside counts
        ([night(850, 860, 855)], (500, 520, 1000), Rule(), Status.INCONCLUSIVE, 2),  # noisy tonight: never fails
        ([], (500, 520, 1000), Rule(consecutive=1), Status.INCONCLUSIVE, 1),  # not even where one check fails
        ([], (900, 1150, 1900), Rule(), Status.INCONCLUSIVE, 0),  # faster, by noise
        ([night(850, 860, 855)] * 2, (850, 860, 855), Rule(consecutive=3), Status.SLOWER, 3),
        ([night(850, 860, 855)], (850, 860, 855), Rule(consecutive=3), Status.SUSPECT, 2),
        ([], (700, 710, 705), Rule(severe=3.0), Status.SUSPECT, 1),  # 29.5% is not worse than 30%
        ([], (690, 700, 695), Rule(severe=3.0), Status.SLOWER, 1),  # 30.5% is
        ([], (100, 110, 105), Rule(severe=None), Status.SUSPECT, 1),  # never at once
        (
            [{"date": "d", "checks": [regress.settle(BASE, [failed(Outcome.OOM)], TOL10).to_dict()]}],
            (850, 860, 855),
            Rule(),
            Status.SLOWER,
            2,
        ),  # a check that did not fit is no recovery
        (
            [night(850, 860, 855, base=BestEntry("winner", BASE.config, 1100.0, 100 * MIB))],
            (850, 860, 855),
            Rule(),
            Status.SUSPECT,
            1,
        ),  # re-baselined since: the streak starts again
        (
            [night(850, 860, 855, base=BestEntry("runner-up 1", BASE.config, 1000.0, 100 * MIB))],
            (850, 860, 855),
            Rule(),
            Status.SUSPECT,
            1,
        ),  # another config's checks are not this one's
    ],
)
def test_a_regression_takes_checks_in_a_row_or_one_far_outside(
    history: list[dict[str, Any]], runs: tuple[float, ...], rule: Rule, status: Status, streak: int
) -> None:
    v = verdict_of(history, *runs, rule=rule)
    assert (v.status, v.streak) == (status, streak)


@pytest.mark.parametrize(
    "exact, first, second", [(True, Status.HEAVIER, Status.HEAVIER), (False, Status.SUSPECT, Status.HEAVIER)]
)
def test_a_gpu_peak_fails_at_once_and_resident_memory_waits_like_speed(
    exact: bool, first: Status, second: Status
) -> None:
    """7% heavier (tolerance 5%, not twice over), the same on every run."""
    rule = Rule(memory_exact=exact)
    assert verdict_of([], 1000, 1000, 1000, peak=107 * MIB, rule=rule).status is first
    assert verdict_of([night(1000, peak=107 * MIB)], 1000, peak=107 * MIB, rule=rule).status is second
    assert verdict_of([night(1000, peak=107 * MIB)], 1000, peak=101 * MIB, rule=rule).status is Status.OK


def test_a_noisy_peak_is_inconclusive() -> None:
    """One run inside the baseline's memory, one far over: the peak (the largest) cannot be judged."""
    m = regress.combine([fit(1000, 100 * MIB), fit(1000, 130 * MIB)])
    assert regress.decide(BASE, [], m, TOL10, Rule(memory_exact=True)).status is Status.INCONCLUSIVE


# --------------------------------------------------------------------------- JUnit and the JSON, in-process


def test_junit_has_a_failure_per_regression_a_skip_per_doubt_and_no_error() -> None:
    checks = [
        check_of([fit(1000)]),
        regress.settle(BASE, [fit(500), fit(500), fit(520)], TOL10),
        check_of([fit(850), fit(860), fit(855)]),
        check_of([fit(500), fit(520), fit(1000)]),
    ]
    root = ET.fromstring(regress.junit_xml(checks, "autofit-regress r"))
    assert [root.get(k) for k in ("name", "tests", "failures", "errors", "skipped")] == [
        "autofit-regress r",
        "4",
        "1",
        "0",
        "2",
    ]
    cases = root.findall("testcase")
    assert cases[0].find("failure") is None and cases[0].find("system-out").text == checks[0].messages[0]
    failure = cases[1].find("failure")
    assert failure.get("type") == "slower" and failure.get("message") == "slower: " + "; ".join(checks[1].messages)
    assert json.loads(failure.text)["runs"] == [500, 500, 520]
    for case, c in zip(cases[2:], checks[2:]):  # what mikepenz/action-junit-report and pytest call skipped
        skipped = case.find("skipped")
        assert skipped.get("type") == c.status.value and skipped.get("message").startswith(f"{c.status.value}: ")
        assert case.find("failure") is None and json.loads(skipped.text)["status"] == c.status.value
    assert [c.status for c in checks[2:]] == [Status.SUSPECT, Status.INCONCLUSIVE]
    assert root.find(".//error") is None


@pytest.mark.parametrize(
    "statuses, verdict",
    [
        ([Status.OK, Status.FASTER], "pass"),
        ([Status.OK, Status.INCONCLUSIVE], "inconclusive"),
        ([Status.INCONCLUSIVE, Status.SUSPECT], "suspect"),
        ([Status.SUSPECT, Status.HEAVIER], "regression"),
        ([Status.NO_LONGER_FITS], "regression"),
    ],
)
def test_the_job_verdict_is_its_worst_check(statuses: list[Status], verdict: str) -> None:
    checks = [replace(check_of([fit(1000)]), status=s) for s in statuses]
    assert regress.verdict(checks) == verdict


def test_junit_error_is_an_error_not_a_failure() -> None:
    root = ET.fromstring(
        regress.junit_error("autofit-regress r", "RUN: r/best.json is not valid JSON\nmore", "UsageError")
    )
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("1", "0", "1")
    error = root.find("testcase/error")
    assert error.get("type") == "UsageError" and error.get("message") == "RUN: r/best.json is not valid JSON"
    assert error.text == "RUN: r/best.json is not valid JSON\nmore" and root.find(".//failure") is None


def test_reports_are_claimed_as_not_finished_then_replaced(tmp_path: Path) -> None:
    js, xml = tmp_path / "r.json", tmp_path / "r.xml"
    reports = regress.Reports.claim(str(js), str(xml), str(tmp_path / "run"))
    error = ET.parse(xml).getroot().find("testcase/error")
    assert error.get("type") == "NotFinished" and error.text == regress.NOT_FINISHED
    assert json.loads(js.read_text()) == {
        "run": str(tmp_path / "run"),
        "verdict": None,
        "regression": None,
        "error": regress.NOT_FINISHED,
        "error_type": "NotFinished",
        "checks": [],
    }
    checks = [check_of([fit(1000)])]
    reports.write({"regression": False, "checks": [c.to_dict() for c in checks]}, checks)
    assert ET.parse(xml).getroot().get("errors") == "0" and ET.parse(xml).getroot().get("tests") == "1"
    assert json.loads(js.read_text())["checks"][0]["status"] == "ok"
    reports.error(UsageError("RUN: bad"))
    assert ET.parse(xml).getroot().find("testcase/error").text == "RUN: bad"
    assert json.loads(js.read_text())["error"] == "RUN: bad"


@pytest.mark.parametrize("where", ["file.txt/x.xml", "missing/x.xml"])
def test_an_unwritable_junit_path_is_a_usage_error_and_json_gets_it(tmp_path: Path, where: str) -> None:
    (tmp_path / "file.txt").write_text("a regular file")
    js, xml = tmp_path / "r.json", tmp_path / where
    with pytest.raises(UsageError) as e:
        regress.Reports.claim(str(js), str(xml), "run")
    why = "Not a directory" if where.startswith("file.txt") else "No such file or directory"
    message = f"--junit: cannot write {xml} ({why}); give a path in a writable folder."
    assert e.value.problems == [message]
    assert json.loads(js.read_text())["error"] == message


@pytest.mark.parametrize(
    "where, error, message",
    [
        ("folder", UsageError, "--json: {json} is a folder; give a file name (a path in it, or beside it)."),
        (
            "loop",
            UsageError,
            "--json: {json} is a symbolic link loop (or a chain of links too long to follow). Give a file path.",
        ),
        (
            "/dev/full",
            CannotWrite,
            "--json: cannot write /dev/full (No space left on device); give a path in a writable "
            "folder with free space.",
        ),
        (
            "x" * 300 + ".json",
            UsageError,
            "--json: cannot write {json} (File name too long); give a path in a writable folder.",
        ),
        (
            "run/regress-history.jsonl",
            UsageError,
            "--json: {json} is a file of the run folder {run} (the run's own "
            "record); give a path outside it, or a new file name.",
        ),
        (
            "run/regress-trend.png",
            UsageError,
            "--json: {json} is a file of the run folder {run} (the run's own "
            "record); give a path outside it, or a new file name.",
        ),
    ],
)
def test_a_report_path_that_cannot_take_the_file_is_refused_before_measuring(
    tmp_path: Path, where: str, error: type[Exception], message: str
) -> None:
    """A symlink loop or a name too long was a traceback; the history's or the plot's path, before the first
    job, would have been replaced by the report (or its record appended into the report); a full disk was
    exit 2."""
    run = write_run(tmp_path / "run")
    js = Path(where) if where.startswith("/") else tmp_path / where
    if where == "folder":
        js.mkdir()
    elif where == "loop":
        js.symlink_to(js)
    with pytest.raises(error) as e:
        regress.Reports.claim(str(js), str(tmp_path / "r.xml"), str(run))
    assert str(e.value) == message.format(json=js, run=run)
    assert ET.parse(tmp_path / "r.xml").getroot().find("testcase/error").text == str(e.value)
    assert sorted(p.name for p in run.iterdir()) == ["best.json", "env.json", "spec.yaml"]


# --------------------------------------------------------------------------- history, in-process


def test_history_appends_one_entry_per_job_and_skips_a_line_cut_short(tmp_path: Path) -> None:
    env = {"gpus": [], "driver": None, "packages": {"torch": "2.13.0+cpu"}}
    first = regress.append_history(tmp_path, [check_of([fit(1000)])], env, 2 * 2**30, TOL10, Rule())
    with open(tmp_path / regress.HISTORY, "a") as f:
        f.write('{"date": "2026-')  # a job killed while writing: no newline after it
    second = regress.append_history(tmp_path, [check_of([fit(500), fit(500), fit(500)])], env, None)
    said: list[str] = []
    history = regress.read_history(tmp_path, said.append)
    assert history == [first, second]
    assert said == [
        f"RUN: {tmp_path / regress.HISTORY} line 2 is damaged (not JSON: Unterminated string starting "
        "at); skipped, the other records are read"
    ]
    lines = (tmp_path / regress.HISTORY).read_text().split("\n")
    assert lines[1] == '{"date": "2026-' and json.loads(lines[2]) == second and lines[3:] == [""]
    assert first["gpu"] == "cpu" and first["memory_limit_bytes"] == 2 * 2**30
    assert first["tolerance"] == {"speed": 0.10, "memory": 0.05} and first["rule"]["consecutive"] == 2
    assert [h["checks"][0]["status"] for h in history] == ["ok", "slower"]
    assert regress.plot_trend(tmp_path, history).is_file()


RECORD = json.dumps(json.loads(NIGHTS.read_text().splitlines()[0]))


@pytest.mark.parametrize(
    "line, problem",
    [
        (b"not json", "not JSON: Expecting value"),
        (
            b'{"date": "2026-03-01", "che\xff',
            "not JSON: 'utf-8' codec can't decode byte 0xff in position 27: invalid start byte",
        ),
        (b"[1, 2, 3]", "not a regress record: no date and list of checks"),
        (b"\x00\x00garbage", "not JSON: Expecting value"),
        (
            b"[" * 100_000,
            "not JSON: maximum recursion depth exceeded while decoding a JSON array from a unicode string",
        ),
        (
            b'{"date": "2026-03-01", "checks": [{"name": "winner"}]}',
            "a check without baseline_tokens_per_s, baseline_peak_bytes, tokens_per_s, peak_bytes, status",
        ),
        (
            RECORD.replace('"baseline_peak_bytes": 32212254720', '"baseline_peak_bytes": 0').encode(),
            "a check with a baseline that is not positive",
        ),
        (RECORD.replace('"tokens_per_s": 11420,', '"tokens_per_s": true,').encode(), "a check without tokens_per_s"),
        (
            RECORD.replace('"tokens_per_s": 11420,', '"tokens_per_s": NaN,').encode(),
            "a check with a figure that is not a finite number",
        ),
    ],
)
def test_a_damaged_history_line_is_skipped_naming_its_line(tmp_path: Path, line: bytes, problem: str) -> None:
    (tmp_path / regress.HISTORY).write_bytes(RECORD.encode() + b"\n" + line + b"\n\n" + RECORD.encode() + b"\n")
    said: list[str] = []
    assert regress.read_history(tmp_path, said.append) == [json.loads(RECORD)] * 2
    assert said == [
        f"RUN: {tmp_path / regress.HISTORY} line 2 is damaged ({problem}); skipped, the other records are read"
    ]


@pytest.mark.parametrize(
    "name, kind",
    [
        (regress.HISTORY, "folder"),
        (regress.HISTORY, "fifo"),
        (regress.TREND, "folder"),
        (regress.TREND, "fifo"),
        (regress.TREND, "loop"),
    ],
)
def test_a_history_or_plot_that_is_no_file_is_a_usage_error_before_measuring(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A FIFO there made the job hang at its end, opening it to append or to draw into."""
    path = tmp_path / name
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(path)
    with pytest.raises(UsageError) as e:
        regress.read_history(tmp_path)
    what = {
        "folder": "is a folder, not a regular file",
        "fifo": "is a FIFO (named pipe), not a regular file",
        "loop": "is a symbolic link loop (or a chain of links too long to follow)",
    }[kind]
    then = "regress starts a new history" if name == regress.HISTORY else "regress draws a new one"
    assert e.value.problems == [f"RUN: {path} {what}. Move it out of the run folder; {then}."]


def test_a_history_that_cannot_be_written_keeps_the_checks_in_the_reports(tmp_path: Path) -> None:
    p = regress.plan(write_run(tmp_path / "run"), top=1)
    (p.run_dir / regress.HISTORY).mkdir()  # a real fault root cannot write through either
    reports = regress.Reports.claim(str(tmp_path / "r.json"), str(tmp_path / "r.xml"), str(p.run_dir))
    checks = [regress.settle(BASE, [fit(500)] * 3, TOL10)]
    with pytest.raises(CannotWrite) as e:
        regress.record(p, checks, TOL10, Rule(), {}, reports)
    assert e.value.exit_code == 4 and str(e.value).startswith(f"RUN: cannot append to {p.run_dir / regress.HISTORY}")
    assert json.loads((tmp_path / "r.json").read_text())["checks"] == [checks[0].to_dict()]
    assert ET.parse(tmp_path / "r.xml").getroot().find("testcase/failure").get("type") == "slower"


# --------------------------------------------------------------------------- the baseline and target, in-process


def test_plan_reads_the_baseline_and_keeps_the_stored_target(tmp_path: Path) -> None:
    p = regress.plan(write_run(tmp_path / "run"), top=2)
    assert [(c.name, c.config.micro_batch_size, c.tokens_per_s) for c in p.configs] == [
        ("winner", 4, 1000.0),
        ("runner-up 1", 2, 800.0),
    ]
    assert p.target == Target("cpu", None, "", 2 * 2**30, 0.05) and p.run_id == "run"
    assert p.probe.timeout_s == 900.0 and p.env_before["packages"] == {"torch": "2.0.0"}
    assert [c.name for c in regress.plan(tmp_path / "run", top=1).configs] == ["winner"]


def test_the_memory_tolerance_allows_resident_memory_its_noise_on_the_cpu() -> None:
    """Without --memory-tolerance: 10% on the CPU (resident memory: +5.8% was once called heavier with
    nothing changed), 3% on a GPU (the allocator's exact peak)."""
    assert regress.default_memory_tolerance(Target("cpu", None, "", None)) == 0.10
    assert regress.default_memory_tolerance(Target("cuda", 0, "NVIDIA H200", None)) == 0.03


def test_a_memory_limit_flag_replaces_the_stored_limit() -> None:
    stored = Target("cpu", None, "", 90 * MIB, 0.05)
    assert regress.choose_target(stored, None, None, None) is stored
    assert regress.choose_target(stored, None, None, "2GiB") == Target("cpu", None, "", 2 * 2**30, 0.05)
    assert regress.choose_target(stored, None, "cpu", None) == stored


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"outcome":',
            (
                "RUN: {best} is not valid JSON (line 1 column 12: Expecting value); "
                "`autofit report {run}` rewrites it from the study."
            ),
        ),
        (
            "[1,2,3]",
            (
                "RUN: {best} holds a JSON list, not an object with the winner; "
                "`autofit report {run}` rewrites it from the study."
            ),
        ),
    ],
)
def test_a_corrupt_best_json_is_a_usage_error_naming_it(tmp_path: Path, content: str, message: str) -> None:
    run = write_run(tmp_path / "run")
    (run / "best.json").write_text(content)
    with pytest.raises(UsageError) as e:
        regress.plan(run, top=1)
    assert e.value.problems == [message.format(best=run / "best.json", run=run)]


def test_a_best_json_without_figures_names_each_problem(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run", tokens_per_s=None, runners_up=[{"config": {}, "tokens_per_s": 5, "peak_memory_bytes": True}]
    )
    with pytest.raises(UsageError) as e:
        regress.plan(run, top=1)
    best = run / "best.json"
    assert e.value.problems == [
        f"RUN: {best}: the winner: tokens_per_s is None, expected a positive number",
        f"RUN: {best}: the runner-up 1: peak_memory_bytes is True, expected a positive number",
        f"RUN: `autofit report {run}` rewrites it from the study.",
    ]


def test_other_gpu_models_and_top_0_are_refused(tmp_path: Path) -> None:
    h200 = {"device": "cuda", "gpu_index": 0, "gpu_name": "NVIDIA H200", "memory_limit_bytes": None}
    run = write_run(tmp_path / "run", target=h200)
    with pytest.raises(UsageError) as e:
        regress.plan(run, top=1, device="cpu")
    assert e.value.problems == [
        (
            "the baseline was measured on NVIDIA H200, this check would run on cpu: figures from different GPUs "
            "are not comparable. Run on the baseline's GPU model, or pass --allow-gpu-change (and then "
            "--update-baseline) to start a new baseline."
        )
    ]
    assert regress.plan(run, top=1, device="cpu", allow_gpu_change=True).target.device == "cpu"
    with pytest.raises(UsageError, match=r"^--top: at least 1 \(the winner\)\.$"):
        regress.plan(run, top=0)


def test_bad_input_in_process_exits_2_with_a_junit_error(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    (run / "best.json").write_text("[1,2,3]")
    xml = tmp_path / "r.xml"
    assert main(["regress", str(run), "--junit", str(xml)]) == 2
    error = ET.parse(xml).getroot().find("testcase/error")
    assert error.get("type") == "UsageError" and error.text.startswith(f"RUN: {run / 'best.json'} holds a JSON list")
    assert main(["regress", str(run), "--junit", str(xml), "--tolerance", "lots"]) == 2
    assert ET.parse(xml).getroot().find("testcase/error").text == (
        "--tolerance: 'lots' is not a tolerance; expected a percentage such as 7% (or 0.07)."
    )


# --------------------------------------------------------------------------- re-baselining, in-process


def test_update_baseline_rewrites_the_figures_and_keeps_the_old_ones(tmp_path: Path) -> None:
    p = regress.plan(write_run(tmp_path / "run"), top=2)
    checks = [regress.settle(c, [fit(t, 90 * MIB)] * 3, TOL10) for c, t in zip(p.configs, (2000, 700))]
    kept = regress.update_baseline(p, checks, {"packages": {"torch": "2.13.0+cpu"}})
    assert json.loads(kept.read_text()) == p.best.doc
    best = json.loads((p.run_dir / "best.json").read_text())
    assert (best["tokens_per_s"], best["peak_memory_bytes"]) == (2000, 90 * MIB)
    assert best["runners_up"][0]["tokens_per_s"] == 700 and best["baseline_updated"] in kept.name
    assert json.loads((p.run_dir / "env.json").read_text()) == {"packages": {"torch": "2.13.0+cpu"}}
    assert len(list(p.run_dir.glob("env.previous-*.json"))) == 1


@pytest.mark.parametrize(
    "runs, said",
    [
        ([(1000,), (800,)], ""),
        ([(2000, 1900, 2100), (800,)], ""),  # faster: what re-baselining is for
        (
            [(850, 860, 855), (800,)],
            "the new baseline takes in figures outside the tolerance (winner suspect); drop "
            "--update-baseline from a nightly job",
        ),
        (  # the inconclusive runner-up keeps its baseline: not taken in
            [(500, 510, 520), (500, 520, 1000)],
            "the new baseline takes in a regression (winner slower); drop --update-baseline from a nightly job",
        ),
    ],
)
def test_a_new_baseline_says_what_it_takes_in(tmp_path: Path, runs: list[tuple[float, ...]], said: str) -> None:
    p = regress.plan(write_run(tmp_path / "run"), top=2)
    checks = [regress.settle(c, [fit(t) for t in ts], TOL10) for c, ts in zip(p.configs, runs)]
    assert regress.taken_in(checks) == said


def test_a_new_baseline_is_the_runs_measured_not_old_steps_beside_new_figures(tmp_path: Path) -> None:
    """Only tokens/s and the peak were replaced: best.json kept the old runs, step range and noisy flag, and
    export's header gave 1,340 tokens/s as "the median of 2 fresh processes (13,615, 14,701)"."""
    p = regress.plan(write_run(tmp_path / "run"), top=2)
    old = json.loads(p.best.path.read_text())
    old["extra"] = {"measurements": [13615.3, 14701.1]}
    old.update(tokens_per_s_min=12251.8, tokens_per_s_max=13756.8, noisy=True, step_times=[9.0, 9.0])
    p.best.path.write_text(json.dumps(old))
    p = regress.plan(p.run_dir, top=2)

    def run(tps: float, low: float, high: float) -> ProbeResult:
        return replace(fit(tps, 90 * MIB), tokens_per_s_min=low, tokens_per_s_max=high, step_times=[0.5, 0.5],
                       log_path=f"logs/regress-{tps:.0f}.log")

    runs = [run(1300, 1250, 1320), run(1340, 1300, 1390), run(1360, 1330, 1400)]
    checks = [regress.settle(p.configs[0], runs, TOL10), regress.settle(p.configs[1], [fit(700)], TOL10)]
    regress.update_baseline(p, checks, {})
    best = json.loads(p.best.path.read_text())
    assert best["tokens_per_s"] == 1340 and best["extra"]["measurements"] == [1300, 1340, 1360]
    assert (best["tokens_per_s_min"], best["tokens_per_s_max"]) == (1250, 1400)
    assert best["noisy"] is False and best["step_times"] == [0.5, 0.5]
    assert best["log_path"] == "logs/regress-1300.log"  # the first run's, as the search keeps its first probe's
    assert (best["run_id"], best["config"]) == (old["run_id"], old["config"])  # the run's fields are kept


def test_an_inconclusive_check_keeps_its_baseline(tmp_path: Path) -> None:
    """--update-baseline took a check it called too noisy to judge as the new baseline (10x below the old)."""
    p = regress.plan(write_run(tmp_path / "run"), top=2)
    before = p.best.path.read_bytes()
    noisy = [fit(100), fit(200), fit(1250)]
    assert regress.settle(p.configs[0], noisy, TOL10).status is Status.INCONCLUSIVE
    assert regress.update_baseline(p, [regress.settle(c, noisy, TOL10) for c in p.configs], {}) is None
    assert p.best.path.read_bytes() == before and not list(p.run_dir.glob("best.previous-*"))
    checks = [regress.settle(p.configs[0], noisy, TOL10), regress.settle(p.configs[1], [fit(2000)] * 3, TOL10)]
    regress.update_baseline(p, checks, {})
    best = json.loads(p.best.path.read_text())
    assert best["tokens_per_s"] == p.best.doc["tokens_per_s"] and best["runners_up"][0]["tokens_per_s"] == 2000


def test_a_full_disk_after_measuring_is_exit_4_and_leaves_every_file_whole(tmp_path: Path) -> None:
    """The trend plot and the re-baselined best.json on a disk that filled up: CannotWrite naming the file,
    the old files as they were, no half file and no temporary file left."""
    with full_disk(tmp_path / "disk", "1m", lambda d: write_run(d / "run")) as disk:
        run = disk / "run"
        before = {f.name: f.read_bytes() for f in run.iterdir()}
        p = regress.plan(run, top=1)
        with pytest.raises(CannotWrite) as e:
            regress.plot_trend(run, [night(1000)])
        assert str(e.value) == (
            f"RUN: cannot write the trend plot {run / regress.TREND} (No space left on device); "
            f"the checks are in {run / regress.HISTORY}."
        )
        with pytest.raises(CannotWrite) as e:
            regress.update_baseline(p, [regress.settle(p.configs[0], [fit(2000)] * 3, TOL10)], {})
        kept = str(e.value).split("cannot write ")[1].split(" ")[0]
        assert Path(kept).name.startswith("best.previous-") and str(e.value) == (
            f"RUN: cannot re-baseline {run}: cannot write {kept} (No space left on device); nothing was rewritten; "
            f"the checks are in {run / regress.HISTORY}."
        )
        assert {f.name: f.read_bytes() for f in run.iterdir()} == before


def test_a_report_on_a_read_only_disk_is_exit_4(tmp_path: Path) -> None:
    with read_only_folder(tmp_path / "ro") as ro:
        with pytest.raises(
            CannotWrite,
            match=rf"^--junit: cannot write {ro / 'r.xml'} \(Read-only file system\); "
            "give a path in a writable folder with free space.$",
        ):
            regress.Reports.claim(str(tmp_path / "r.json"), str(ro / "r.xml"), "run")
    assert json.loads((tmp_path / "r.json").read_text())["error_type"] == "CannotWrite"


def test_update_baseline_refuses_a_config_that_no_longer_fits(tmp_path: Path) -> None:
    p = regress.plan(write_run(tmp_path / "run"), top=1)
    before = (p.run_dir / "best.json").read_text()
    with pytest.raises(RegressionFound, match="no longer fits; not re-baselining"):
        regress.update_baseline(p, [regress.settle(BASE, [failed(Outcome.OOM)], TOL10)], {})
    assert (p.run_dir / "best.json").read_text() == before and not list(p.run_dir.glob("*.previous-*"))


# --------------------------------------------------------------------------- end to end (slow)


@pytest.mark.parametrize(
    "args, messages",
    [
        (
            ["--consecutive", "0"],
            [
                "--consecutive: '0' is not a number of checks; give 1 or more (1: every check "
                "outside tolerance is a regression; default 2)."
            ],
        ),
        (
            ["--consecutive", "two", "--severe-factor", "0.5"],
            [
                "--consecutive: 'two' is not a number of checks; give 1 or more (1: every check outside tolerance "
                "is a regression; default 2).",
                "--severe-factor: '0.5' is not a factor of the tolerance; give a number of 1 or more, such as 2 "
                "(a check worse than twice the tolerance fails at once), or off.",
            ],
        ),
        (
            ["--severe-factor", "nan"],
            [
                "--severe-factor: 'nan' is not a factor of the tolerance; give a number of 1 or "
                "more, such as 2 (a check worse than twice the tolerance fails at once), or off."
            ],
        ),
        (
            ["--severe-factor", "inf"],
            [
                "--severe-factor: 'inf' is not a factor of the tolerance; give a number of 1 or "
                "more, such as 2 (a check worse than twice the tolerance fails at once), or off."
            ],
        ),
    ],
)
def test_bad_rule_flags_exit_2_naming_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], messages: list[str]
) -> None:
    run = write_run(tmp_path / "run")
    assert main(["regress", str(run), "--junit", str(tmp_path / "r.xml"), *args]) == 2
    assert capsys.readouterr().err == "".join(f"autofit: error: {m}\n" for m in messages)
    assert ET.parse(tmp_path / "r.xml").getroot().find("testcase/error").text == "\n".join(messages)
    assert not (run / regress.HISTORY).exists()


@pytest.mark.parametrize("text, factor", [("2", 2.0), ("3x", 3.0), (" 1 ", 1.0), ("OFF", None), ("2.5X", 2.5)])
def test_the_severe_factor_reads_a_number_or_off(text: str, factor: float | None) -> None:
    from autofit.cli.regress import severe_factor

    assert severe_factor(text) == factor


# --------------------------------------------------------------------------- several GPUs per probe, in-process


def multi_gpu_run(run_dir: Path, n: int, on_runner_up: bool = False) -> Path:
    """A run stored on an H200 group of n GPUs whose winner (or first runner-up) spans n GPUs (fsdp2)."""
    h200 = {
        "device": "cuda",
        "gpu_index": 0,
        "gpu_name": "NVIDIA H200",
        "memory_limit_bytes": None,
        "ranks": n,
        "gpu_indices": list(range(n)),
    }
    wide = BASE.config.replace(gpus=n, engine="fsdp2").to_dict()
    if on_runner_up:
        entry = {"outcome": "fit", "config": wide, "tokens_per_s": 800.0, "peak_memory_bytes": 100 * MIB}
        run = write_run(run_dir, target=h200, runners_up=[entry])
    else:
        run = write_run(run_dir, target=h200, config=wide)
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["targets"] = [target_dict(Target("cuda", 0, "NVIDIA H200", None, ranks=n, gpu_indices=tuple(range(n))))]
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run


def test_a_run_stored_for_more_gpus_than_attached_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    n = max(2, len(envinfo.gpus()) + 1)  # more than this machine has (none on a CPU-only machine)
    run = multi_gpu_run(tmp_path / "run", n)
    have = len(envinfo.gpus())
    attached = f"{have} {'is' if have == 1 else 'are'} attached here"
    with pytest.raises(UsageError) as e:
        regress.plan(run, top=1)
    assert e.value.problems == [
        f"RUN: {run}: the winner was measured on {n} GPUs (gpus={n}) and {attached}: a probe spans as many "
        f"GPUs as it was stored with. Run `autofit regress` on a host with {n} GPUs of the baseline's model "
        f"(--gpu with {n} indices to choose them)."
    ]
    with pytest.raises(UsageError, match=r"and --gpu 0 names 1: a probe spans"):
        regress.plan(run, top=1, gpu="0")
    xml = tmp_path / "r.xml"
    assert main(["regress", str(run), "--junit", str(xml)]) == 2
    assert ET.parse(xml).getroot().find("testcase/error").text == e.value.problems[0]


def test_a_runner_up_on_more_gpus_names_top_to_check_only_those_before_it(tmp_path: Path) -> None:
    n = max(2, len(envinfo.gpus()) + 1)
    run = multi_gpu_run(tmp_path / "run", n, on_runner_up=True)
    with pytest.raises(
        UsageError,
        match=rf"the runner-up 1 was measured on {n} GPUs .*, or --top 1 to check "
        r"only the configs before it\.$",
    ):
        regress.plan(run, top=2)
    if not envinfo.gpus():  # the winner alone spans one GPU: today's check of the stored GPU remains
        with pytest.raises(UsageError, match="GPU 0 does not exist here"):
            regress.plan(run, top=1)


def test_on_the_cpu_any_number_of_ranks_runs_as_gloo_processes(tmp_path: Path) -> None:
    run = multi_gpu_run(tmp_path / "run", 4)
    p = regress.plan(run, top=1, device="cpu", allow_gpu_change=True)
    assert (p.target.device, p.target.ranks) == ("cpu", 4) and p.configs[0].config.gpus == 4
    stored = Target("cpu", None, "", 90 * MIB, 0.05, ranks=2)
    assert regress.choose_target(stored, None, None, None, per_probe=2) is stored
    assert regress.choose_target(stored, None, None, "2GiB", per_probe=2).ranks == 2
    assert regress.choose_target(Target("cpu", None, "", None), None, None, None, per_probe=3).ranks == 3


def test_the_version_diff_says_none_where_a_machine_has_no_gpu_stack() -> None:
    rows = {
        what: (before, now, changed)
        for what, before, now, changed in regress.version_diff(
            {"packages": {"torch": "2.13.0"}}, {"driver": "580.1", "packages": {"torch": "2.13.0"}}
        )
    }
    assert rows["driver"] == ("none", "580.1", True) and rows["CUDA (driver)"] == ("none", "none", False)
    assert rows["GPU"] == ("none", "none", False) and rows["torch"] == ("2.13.0", "2.13.0", False)


def test_a_run_that_ran_the_checks_does_not_set_the_peak_when_others_did_not() -> None:
    """On the CPU the batching check's freed memory stays resident (measured 128 MiB against 103 for the same
    config): regress, which runs the checks in its first run, called an unchanged dataset run heavier."""
    from autofit.protocol.result import Outcome, ProbeResult
    from autofit.run.regress import combine

    cfg = BASE.config.to_dict()
    checked = ProbeResult(
        Outcome.FIT, cfg, tokens_per_s=1000.0, peak_memory_bytes=128 * MIB, extra={"boundaries": {"ok": True}}
    )
    plain = [ProbeResult(Outcome.FIT, cfg, tokens_per_s=990.0, peak_memory_bytes=p * MIB) for p in (103, 104)]
    assert combine([checked, *plain]).peak_bytes == 104 * MIB
    assert combine([checked]).peak_bytes == 128 * MIB  # one run only: what there is


def test_report_keeps_a_baseline_regress_updated(tmp_path: Path) -> None:
    """`autofit report` rebuilt best.json from the study and put the old baseline back silently."""
    from autofit.run.report.outputs import rebaselined

    p = regress.plan(write_run(tmp_path / "run"), top=1)
    checks = [regress.settle(p.configs[0], [fit(2000, 90 * MIB)] * 3, TOL10)]
    regress.update_baseline(p, checks, {"packages": {}})
    cfg = p.configs[0].config.to_dict()
    assert rebaselined(p.best.path, cfg)
    assert not rebaselined(p.best.path, {**cfg, "micro_batch_size": 2})  # a new winner since: rebuilt
    assert not rebaselined(write_run(tmp_path / "plain") / "best.json", cfg)  # never re-baselined: rebuilt
