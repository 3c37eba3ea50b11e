"""Nightly re-measurement of a stored run: did anything get slower, heavier, or stop fitting?

The baseline is what `RUN/best.json` records (the winner and its runners-up). Each config is
re-probed on the same GPU with the stored settings and limit. A figure outside tolerance is
measured until there are `RUNS_OUTSIDE_TOLERANCE` runs, combined by the search's rule for
repeats (tokens/s the median, `objective.combined_tokens_per_s`; the peak the largest), so one
noisy run neither fails nor passes the job. Every check is appended to
`RUN/regress-history.jsonl`.

The --json and --junit files are claimed before anything is measured: written at once with an
error ("did not finish"), replaced by the checks at the end, or by the error that stopped the
job. A CI job therefore never reads a stale pass, and exit 1 means a regression, nothing else.
"""

from __future__ import annotations

import enum
import json
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import locks
from .data import DatasetRef, stored_dataset
from .envinfo import collect, gpus
from .errors import CannotWrite, RegressionFound, UsageError
from .export.common import Best, BestEntry, read_best, read_env
from .models import ModelSource
from .objective import combined_tokens_per_s
from .protocol import Checks
from .result import ProbeResult
from .rundir import HISTORY, REGRESS_LOCK, RunDir, model_of, read_spec, targets_of
from .runner import Runner
from .target import Target, resolve_targets
from .units import format_size

TREND = "regress-trend.png"
RUNS_OUTSIDE_TOLERANCE = 3
"""Runs of a config whose first figure is outside tolerance: the median of three outvotes one outlier."""


class Status(str, enum.Enum):
    """A check's verdict (stored by value in the history and the JSON)."""

    OK = "ok"
    FASTER = "faster"
    SLOWER = "slower"
    HEAVIER = "heavier"
    NO_LONGER_FITS = "no_longer_fits"

    def failed(self) -> bool:
        """A regression: exit 1 and a JUnit <failure>."""
        return self in (Status.SLOWER, Status.HEAVIER, Status.NO_LONGER_FITS)

    def settled(self) -> bool:
        """No need to measure again: within tolerance, or not fitting at all (an OOM fails at once)."""
        return self in (Status.OK, Status.NO_LONGER_FITS)

    @property
    def mark(self) -> str:
        return "ok" if self is Status.OK else self.value.replace("_", " ").upper()


@dataclass(frozen=True)
class Tolerance:
    """Fractions: slower than `speed`, or heavier than `memory`, is a regression."""

    speed: float
    memory: float


@dataclass(frozen=True)
class Measured:
    """The runs of one config, combined by the search's rule for repeats."""

    fits: bool
    tokens_per_s: float | None
    peak_bytes: int | None
    outcome: str
    reason: str
    runs: tuple[float, ...]
    """tokens/s of each fitting run."""


@dataclass(frozen=True)
class Check:
    """One re-probed configuration against its baseline."""

    name: str
    config: dict[str, Any]
    baseline_tokens_per_s: float
    baseline_peak_bytes: int
    tokens_per_s: float | None
    peak_bytes: int | None
    outcome: str
    attempts: int
    status: Status
    runs: tuple[float, ...]
    messages: tuple[str, ...]

    @property
    def failed(self) -> bool:
        return self.status.failed()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        d["runs"], d["messages"] = list(self.runs), list(self.messages)
        return d


@dataclass(frozen=True)
class Plan:
    """What a regress job measures, where, against what."""

    run_dir: Path
    run_id: str
    model: ModelSource
    probe: dict[str, Any]
    """The search's probe settings (warm-up, timed steps, timeout) from spec.yaml."""
    best: Best
    configs: tuple[BestEntry, ...]
    target: Target
    env_before: dict[str, Any]
    dataset: DatasetRef | None = None
    """The data the search measured on (spec.yaml), checked unchanged; None: random tokens."""


# --------------------------------------------------------------------------- what to check, where


def plan(run_dir: Path, top: int, gpu: str | None = None, device: str | None = None,
         memory_limit: str | None = None, allow_gpu_change: bool = False, dataset: str | None = None) -> Plan:
    """Read the run's baseline and choose the target; bad flags or files are one UsageError."""
    if top < 1:
        raise UsageError("--top: at least 1 (the winner).")
    spec = read_spec(run_dir)
    best = read_best(run_dir)
    configs = best.entries[:top]
    need = max(c.config.gpus for c in configs)
    stored = targets_of(spec)[0]
    check_attached(run_dir, configs, stored, gpu, device)
    target = choose_target(stored, gpu, device, memory_limit, per_probe=need)
    check_gpu(best.target, target, allow_gpu_change)
    ref = stored_dataset(spec, dataset, "the baseline was measured on", "this is not a regression: ")
    return Plan(run_dir, str(spec.get("run_id", run_dir.name)), model_of(spec), dict(spec.get("probe") or {}),
                best, configs, target, read_env(run_dir), ref)


def choose_target(stored: Target, gpu: str | None, device: str | None, memory_limit: str | None,
                  per_probe: int = 1) -> Target:
    """The stored target unless flags say otherwise; a GPU is read again (its name now), and the
    stored memory limit holds unless --memory-limit replaces it. The target spans `per_probe` GPUs
    (the checked configs' largest `gpus`): the stored group's first ones, or the first of --gpu."""
    if gpu is None and device is None:
        if stored.device == "cuda":
            group = stored.gpus[:per_probe]
            gpu = ",".join(map(str, group)) if len(group) == per_probe else None
            device = "cuda"
        elif not memory_limit:
            return stored if stored.ranks >= per_probe else replace(stored, ranks=per_probe)
        else:
            device = "cpu"
    elif gpu is not None and per_probe > 1:
        gpu = ",".join(gpu.split(",")[:per_probe])
    target = resolve_targets(gpu, device, memory_limit, stored.headroom, per_probe)[0]
    return target if memory_limit else replace(target, memory_limit_bytes=stored.memory_limit_bytes)


def check_attached(run_dir: Path, configs: Sequence[BestEntry], stored: Target, gpu: str | None,
                   device: str | None) -> None:
    """A config measured on N GPUs is re-measured on N: fewer attached (or named with --gpu) is a usage
    error naming the run, N and what is here. On the CPU (--device cpu, or a run stored there) the
    ranks are gloo processes, any number of them."""
    need = max(configs, key=lambda c: c.config.gpus)
    n = need.config.gpus
    if n <= 1 or device == "cpu" or (gpu is None and device is None and stored.device == "cpu"):
        return
    try:
        attached = len([int(x) for x in gpu.split(",") if x.strip()]) if gpu is not None else len(gpus())
    except ValueError:
        return  # not a GPU list: target.resolve_targets names the --gpu problem
    if attached >= n:
        return
    here = f"--gpu {gpu} names {attached}" if gpu is not None else f"{attached} {'is' if attached == 1 else 'are'} attached here"
    first = configs.index(need)
    fewer = f", or --top {first} to check only the configs before it" if first else ""
    raise UsageError(f"RUN: {run_dir}: the {need.name} was measured on {n} GPUs (gpus={n}) and {here}: a "
                     f"probe spans as many GPUs as it was stored with. Run `autofit regress` on a host with "
                     f"{n} GPUs of the baseline's model (--gpu with {n} indices to choose them){fewer}.")


def check_gpu(measured_on: dict[str, Any], target: Target, allow_change: bool) -> None:
    was = measured_on.get("gpu_name") if measured_on.get("device") == "cuda" else "cpu"
    now = target.gpu_name if target.device == "cuda" else "cpu"
    if was != now and not allow_change:
        raise UsageError(f"the baseline was measured on {was}, this check would run on {now}: figures from "
                         "different GPUs are not comparable. Run on the baseline's GPU model, or pass "
                         "--allow-gpu-change (and then --update-baseline) to start a new baseline.")


def now_env() -> dict[str, Any]:
    return collect()


def version_diff(before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(what, baseline, now, changed) for GPU, driver, CUDA and each package."""
    def gpu(env: dict[str, Any]) -> str:
        return ", ".join(sorted({g["name"] for g in env.get("gpus", [])})) or "none"

    def text(env: dict[str, Any], key: str) -> str:
        return "none" if env.get(key) is None else str(env[key])  # as `autofit env` says it

    rows = [("GPU", gpu(before), gpu(now)), ("driver", text(before, "driver"), text(now, "driver")),
            ("CUDA (driver)", text(before, "cuda_driver"), text(now, "cuda_driver")),
            ("torch CUDA build", text(before, "torch_cuda_build"), text(now, "torch_cuda_build"))]
    pk_b, pk_n = before.get("packages", {}), now.get("packages", {})
    for pkg in sorted(set(pk_b) | set(pk_n)):
        rows.append((pkg, pk_b.get(pkg, "-"), pk_n.get(pkg, "-")))
    return [(w, b, n, b != n) for w, b, n in rows]


# --------------------------------------------------------------------------- judging


def judge(base: BestEntry, m: Measured, tol: Tolerance) -> Status:
    if not m.fits:
        return Status.NO_LONGER_FITS
    tps, peak = m.tokens_per_s or 0.0, m.peak_bytes or 0
    if tps < base.tokens_per_s * (1 - tol.speed):
        return Status.SLOWER
    if peak > base.peak_memory_bytes * (1 + tol.memory):
        return Status.HEAVIER
    if tps > base.tokens_per_s * (1 + tol.speed):
        return Status.FASTER
    return Status.OK


def combine(results: Sequence[ProbeResult]) -> Measured:
    """The search's rule for repeats: tokens/s the median of the fitting runs, the peak the largest;
    a run out of memory (or no fitting run at all) means the config no longer fits. Other failures
    of a repeat (a crash, a timeout) are not counted."""
    fits = [r for r in results if r.outcome.is_fit() and r.tokens_per_s]
    runs = tuple(r.tokens_per_s or 0.0 for r in fits)
    failed = [r for r in results if r.outcome.is_memory()] or ([] if fits else list(results))
    if failed:
        return Measured(False, None, failed[0].peak_memory_bytes, failed[0].outcome.value, failed[0].reason, runs)
    clean = [r for r in fits if not ran_checks(r)] or fits  # a check's residue is not the config's memory
    peak = max(r.peak_memory_bytes or 0 for r in clean)
    return Measured(True, combined_tokens_per_s(list(runs)), peak or None, fits[0].outcome.value, "", runs)


def ran_checks(r: ProbeResult) -> bool:
    """The probe ran a correctness check before training (the kernel gate, the batching check): on the
    CPU the memory the check freed stays resident and counts in its peak."""
    return bool(r.extra.get("gate") or r.extra.get("boundaries"))


def check_config(base: BestEntry, measure: Callable[[int], ProbeResult], tol: Tolerance) -> Check:
    """Measure once; outside tolerance, measure until there are RUNS_OUTSIDE_TOLERANCE runs, then judge."""
    results = [measure(1)]
    if not judge(base, combine(results), tol).settled():
        results += [measure(n) for n in range(2, RUNS_OUTSIDE_TOLERANCE + 1)]
    return settle(base, results, tol)


def settle(base: BestEntry, results: Sequence[ProbeResult], tol: Tolerance) -> Check:
    """The check of `base` from its runs."""
    m = combine(results)
    status = judge(base, m, tol)
    check = Check(base.name, base.config.to_dict(), base.tokens_per_s, base.peak_memory_bytes, m.tokens_per_s,
                  m.peak_bytes, m.outcome, len(results), status, m.runs, ())
    return replace(check, messages=describe(check, m, tol))


def describe(c: Check, m: Measured, tol: Tolerance) -> tuple[str, ...]:
    if c.status is Status.NO_LONGER_FITS:
        line = (f"{c.name} no longer fits: outcome {m.outcome} ({m.reason}); baseline "
                f"{c.baseline_tokens_per_s:,.0f} tokens/s at {format_size(c.baseline_peak_bytes)}")
        return (line,)
    dt = (c.tokens_per_s or 0) / c.baseline_tokens_per_s - 1
    dm = (c.peak_bytes or 0) / c.baseline_peak_bytes - 1
    runs = f"median of {len(c.runs)} runs" if len(c.runs) > 1 else "1 run"
    line = (f"{c.name}: {c.tokens_per_s:,.0f} tokens/s vs baseline {c.baseline_tokens_per_s:,.0f} ({dt:+.1%}, "
            f"tolerance {tol.speed:.0%}); peak {format_size(c.peak_bytes)} vs {format_size(c.baseline_peak_bytes)} "
            f"({dm:+.1%}, tolerance {tol.memory:.0%}); {runs}")
    if c.status is Status.FASTER:
        hint = (f"{c.name} is faster than its baseline beyond tolerance: re-baseline by running this "
                "command again with --update-baseline")
        return (line, hint)
    return (line,)


# --------------------------------------------------------------------------- measuring


def run_checks(p: Plan, tol: Tolerance, on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Re-probe each baseline config in fresh probe processes, with the search's probe settings."""
    checks = []
    with Runner(p.target, p.run_dir / "logs", standby=1,
                warmup_steps=p.probe.get("warmup_steps", 2), timed_steps=p.probe.get("timed_steps", 5),
                max_probe_accumulation=p.probe.get("max_probe_accumulation", 4),
                dataset=p.dataset.to_dict() if p.dataset else None, data_cache=p.run_dir / "data") as runner:
        for i, base in enumerate(p.configs):
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")

            def measure(attempt: int, base: BestEntry = base, i: int = i, stamp: str = stamp) -> ProbeResult:
                # every correctness check in the first run (a nightly run must catch a kernel or a strategy
                # that broke); the runs that settle a figure outside tolerance train only
                checks = Checks() if attempt == 1 else Checks(gate=False, boundaries=False)
                return runner.run(base.config, p.model, name=f"regress-{stamp}-{i}-{attempt}",
                                  timeout=p.probe.get("timeout_s", 900), checks=checks)

            checks.append(check_config(base, measure, tol))
            if on_check:
                on_check(checks[-1])
    return checks


# --------------------------------------------------------------------------- what is written


def summary(p: Plan, checks: Sequence[Check], tol: Tolerance, env_now: dict[str, Any]) -> dict[str, Any]:
    """The --json document."""
    return {"run": str(p.run_dir), "target": p.target.describe(), "tolerance": tol.speed,
            "memory_tolerance": tol.memory, "regression": any(c.failed for c in checks), "error": None,
            "checks": [c.to_dict() for c in checks],
            "versions": [{"what": w, "baseline": b, "now": n, "changed": ch}
                         for w, b, n, ch in version_diff(p.env_before, env_now)]}


def junit_xml(checks: Sequence[Check], suite: str) -> str:
    """One test case per config: a regression is a <failure> of its type."""
    root = ET.Element("testsuite", name=suite, tests=str(len(checks)),
                      failures=str(sum(c.failed for c in checks)), errors="0")
    for c in checks:
        case = ET.SubElement(root, "testcase", classname="autofit.regress", name=c.name)
        if c.failed:
            fail = ET.SubElement(case, "failure", message=f"{c.status.value}: " + "; ".join(c.messages)[:500],
                                 type=c.status.value)
            fail.text = json.dumps(c.to_dict(), indent=1)
        else:
            ET.SubElement(case, "system-out").text = "; ".join(c.messages)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def junit_error(suite: str, message: str, kind: str) -> str:
    """The job could not check anything (bad input, a file it cannot read, or it never finished):
    one test case with an <error>, which CI shows apart from a regression's <failure>."""
    root = ET.Element("testsuite", name=suite, tests="1", failures="0", errors="1")
    case = ET.SubElement(root, "testcase", classname="autofit.regress", name="regress")
    ET.SubElement(case, "error", message=message.splitlines()[0][:500] if message else kind,
                  type=kind).text = message
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


NOT_FINISHED = ("autofit regress did not finish: it was stopped, killed, or failed before writing its "
                "results; see its output")


@dataclass(frozen=True)
class Reports:
    """The --json and --junit files of one job."""

    json_path: Path | None
    junit_path: Path | None
    run: str

    @property
    def suite(self) -> str:
        return f"autofit-regress {Path(self.run).name}"

    @classmethod
    def claim(cls, json_path: str | None, junit_path: str | None, run: str) -> Reports:
        """Write both files at once, each with the error "did not finish", before anything is measured.
        A path that cannot be written is a UsageError naming its flag; the other file still gets the error."""
        reports = cls(Path(json_path) if json_path else None, Path(junit_path) if junit_path else None, run)
        problems = reports.clashes()
        if problems:
            raise UsageError(problems)
        for flag, path in (("--json", reports.json_path), ("--junit", reports.junit_path)):
            if path is not None:
                try:
                    write_text(path, reports.error_text(path, NOT_FINISHED, "NotFinished"), flag)
                except UsageError as e:
                    problems += e.problems
        if problems:
            reports.error(UsageError(problems))
            raise UsageError(problems)
        return reports

    def clashes(self) -> list[str]:
        """Paths that would replace what the job reads or writes itself: the run folder's own files (its
        study, best.json, history), one file for both reports, or '-' (stdout holds the report lines)."""
        out = []
        for flag, path in (("--json", self.json_path), ("--junit", self.junit_path)):
            if path is None:
                continue
            if str(path) == "-":
                out.append(f"{flag}: '-' would mix the file into the report printed on stdout; give a file path.")
            elif path.exists() and RunDir(Path(self.run)).owns(path):
                out.append(f"{flag}: {path} is a file of the run folder {self.run} (the run's own record); "
                           "give a path outside it, or a new file name.")
        if self.json_path and self.junit_path and self.json_path.resolve() == self.junit_path.resolve():
            out.append(f"--json and --junit both name {self.json_path}; give two paths.")
        return out

    def error_text(self, path: Path, message: str, kind: str) -> str:
        if path == self.junit_path:
            return junit_error(self.suite, message, kind)
        return json.dumps({"run": self.run, "regression": None, "error": message,
                           "error_type": kind, "checks": []}, indent=1) + "\n"

    def error(self, e: Exception) -> None:
        """Replace what can still be written with the error that stopped the job (never raises)."""
        for path in (self.json_path, self.junit_path):
            if path is not None:
                try:
                    path.write_text(self.error_text(path, str(e), type(e).__name__))
                except OSError:
                    pass  # the claim already named this path; the error itself is what the user sees

    def write(self, doc: dict[str, Any], checks: Sequence[Check]) -> None:
        if self.json_path is not None:
            write_text(self.json_path, json.dumps(doc, indent=1) + "\n", "--json", CannotWrite)
        if self.junit_path is not None:
            write_text(self.junit_path, junit_xml(checks, self.suite), "--junit", CannotWrite)


def write_text(path: Path, text: str, flag: str, error: type[Exception] = UsageError) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise error(f"{flag}: cannot write {path} ({e.strerror}); give a path in a writable folder.") from None


def one_at_a_time(run_dir: Path, say: Callable[[str], None]) -> AbstractContextManager[None]:
    """Hold the run's regress lock while measuring and recording. Two regress jobs of one run (a nightly
    job that overran into the next) would each measure under the other's load and append to one history:
    the second waits for the first."""
    return locks.held(run_dir / REGRESS_LOCK, lambda who: say(
        f"another autofit regress of this run is measuring ({who}); waiting for it to finish, so that neither "
        "measures under the other's load (Ctrl-C to stop)"))


def append_history(run_dir: Path, checks: Sequence[Check], env: dict[str, Any],
                   limit: int | None) -> dict[str, Any]:
    entry = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "gpu": ", ".join(g["name"] for g in env.get("gpus", [])) or "cpu",
             "driver": env.get("driver"), "packages": env.get("packages"), "memory_limit_bytes": limit,
             "checks": [c.to_dict() for c in checks]}
    try:
        with open(run_dir / HISTORY, "a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError as e:
        raise CannotWrite(f"RUN: cannot append to {run_dir / HISTORY} ({e.strerror}); the checks are in "
                          "the output above (and in --json where given).") from None
    return entry


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """Entries of the history, oldest first; a line that is not a JSON object (a write cut short) is skipped."""
    path = run_dir / HISTORY
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("checks"), list):
            out.append(entry)
    return out


def plot_trend(run_dir: Path, history: list[dict[str, Any]]) -> Path:
    # Deferred: matplotlib takes a second to import and only the trend plot needs it.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / TREND
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True)
    for name in sorted({c["name"] for h in history for c in h["checks"]}):
        points = [(i, c) for i, h in enumerate(history) for c in h["checks"] if c["name"] == name]
        xs = [i for i, _ in points]
        a1.plot(xs, [c["tokens_per_s"] or 0 for _, c in points], marker="o", label=name)
        a2.plot(xs, [(c["peak_bytes"] or 0) / 2**30 for _, c in points], marker="o", label=name)
        last = points[-1][1]
        a1.axhline(last["baseline_tokens_per_s"], linestyle=":", color="gray")
        a2.axhline(last["baseline_peak_bytes"] / 2**30, linestyle=":", color="gray")
    a1.set_ylabel("tokens/s")
    a2.set_ylabel("peak GiB")
    a2.set_xlabel("check (oldest first); dotted: baseline")
    a2.set_xticks(range(len(history)), [h["date"][:10] for h in history], rotation=30, fontsize=7)
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def record(p: Plan, checks: Sequence[Check], tol: Tolerance, env_now: dict[str, Any],
           reports: Reports) -> Path:
    """The history, --json and --junit (both written even when the history cannot be), the trend plot."""
    try:
        append_history(p.run_dir, checks, env_now, p.target.memory_limit_bytes)
    finally:
        reports.write(summary(p, checks, tol, env_now), checks)
    return plot_trend(p.run_dir, read_history(p.run_dir))


# --------------------------------------------------------------------------- re-baselining


def update_baseline(p: Plan, checks: Sequence[Check], env: dict[str, Any]) -> Path:
    """Rewrite best.json (and env.json) with the new figures; keep the previous ones beside them.
    A config that no longer fits is not a baseline: RegressionFound, nothing rewritten."""
    if any(c.status is Status.NO_LONGER_FITS for c in checks):
        raise RegressionFound("a baseline config no longer fits; not re-baselining. Search again.")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kept = p.run_dir / f"best.previous-{stamp}.json"
    best = json.loads(json.dumps(p.best.doc))  # a copy to edit
    entries = [best, *best.get("runners_up", [])]
    for entry, c in zip(entries, checks):
        entry["tokens_per_s"], entry["peak_memory_bytes"] = c.tokens_per_s, c.peak_bytes
    best["baseline_updated"] = stamp
    try:
        shutil.copy2(p.best.path, kept)
        if (p.run_dir / "env.json").is_file():
            shutil.copy2(p.run_dir / "env.json", p.run_dir / f"env.previous-{stamp}.json")
        p.best.path.write_text(json.dumps(best, indent=1) + "\n")
        (p.run_dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    except OSError as e:
        raise CannotWrite(f"RUN: cannot re-baseline {p.run_dir} ({e.strerror}: {e.filename}); the checks "
                          f"are in {p.run_dir / HISTORY}.") from None
    return kept
