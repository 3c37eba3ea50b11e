"""Nightly re-measurement of a stored run: did anything get slower, heavier, or stop fitting?

The baseline is what `RUN/best.json` records (the winner and its runners-up). Each config is
re-probed on the same GPU with the stored settings and limit. A figure outside tolerance is
measured until there are `RUNS_OUTSIDE_TOLERANCE` runs, combined by the search's rule for
repeats (tokens/s the median, `objective.combined_tokens_per_s`; the peak the largest), so one
noisy run neither fails nor passes the job. Every check is appended to
`RUN/regress-history.jsonl`.

A figure outside tolerance is a regression only on more evidence than one check (`Rule`, decided
by `decide` from the baseline, the history and tonight's runs): outside on `consecutive` checks
in a row against one baseline, or once by more than `severe` times the tolerance. A single check
outside is "suspect"; one whose runs disagree among themselves as much as they differ from the
baseline is "inconclusive" (noise that large can make the difference by itself). Both exit 0
with a warning and a JUnit <skipped>. A config that no longer fits fails at once, always; so does
a GPU peak beyond tolerance (the allocator's figure is exact: no noise to wait out).

The --json and --junit files are claimed before anything is measured: written at once with an
error ("did not finish"), replaced by the checks at the end, or by the error that stopped the
job. A CI job therefore never reads a stale pass, and exit 1 means a regression, nothing else.
Every file is written whole or not at all (`files`), and the history gets one record a line.
"""

from __future__ import annotations

import enum
import json
import math
import os
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autofit.config.models import ModelSource
from autofit.config.spec import Value
from autofit.config.target import Target, resolve_targets
from autofit.core.documents import JSONObject
from autofit.core.envinfo import Env, collect, gpus
from autofit.core.errors import AutofitError, CannotWrite, RegressionFound, UsageError
from autofit.core.files import append_line, cannot_write, save_figure, write_atomic, write_json
from autofit.core.paths import input_file, output_file, shown
from autofit.core.units import format_size
from autofit.data import DatasetRef, stored_dataset
from autofit.probe.runner import Runner
from autofit.protocol.request import Checks
from autofit.protocol.result import ProbeResult
from autofit.run import locks
from autofit.run.best import Best, BestEntry, read_best, read_env
from autofit.run.rundir import HISTORY, REGRESS_LOCK, ProbeSettings, RunDir, load_spec
from autofit.search.objective import combined_tokens_per_s
from autofit.search.study import merge_repeats

HistoryRecord = dict[str, Any]
"""One line of regress-history.jsonl (JSON): the date, the machine and tolerances, and each check as
`Check.to_dict()` wrote it; `read_history` keeps only records whose checks hold the figures the rule and the
plot read (`RECORD_FIELDS`)."""

TREND = "regress-trend.png"
RUNS_OUTSIDE_TOLERANCE = 3
"""Runs of a config whose first figure is outside tolerance: the median of three outvotes one outlier."""
CONSECUTIVE = 2
"""Checks in a row outside tolerance that make a regression (PyTorch's HUD: two consecutive points)."""
SEVERE = 2.0
"""A check further outside than this many tolerances is a regression at once."""
MEMORY_TOLERANCE_GPU = 0.03
"""The allocator's peak on a GPU is exact: a few percent is a real change."""
MEMORY_TOLERANCE_CPU = 0.10
"""On the CPU the peak is the process's resident memory, which moves by several percent between runs."""


class Status(str, enum.Enum):
    """A check's verdict (stored by value in the history and the JSON)."""

    OK = "ok"
    FASTER = "faster"
    SUSPECT = "suspect"
    """Outside tolerance on this check, not (yet) on enough checks in a row to be a regression."""
    INCONCLUSIVE = "inconclusive"
    """Outside tolerance, but the runs disagree among themselves as much: too noisy to judge."""
    SLOWER = "slower"
    HEAVIER = "heavier"
    NO_LONGER_FITS = "no_longer_fits"

    def failed(self) -> bool:
        """A regression: exit 1 and a JUnit <failure>."""
        return self in (Status.SLOWER, Status.HEAVIER, Status.NO_LONGER_FITS)

    def doubtful(self) -> bool:
        """Outside tolerance, not a regression on this evidence: exit 0, a warning, a JUnit <skipped>."""
        return self in (Status.SUSPECT, Status.INCONCLUSIVE)

    def settled(self) -> bool:
        """No need to measure again: within tolerance, or not fitting at all (an OOM fails at once)."""
        return self in (Status.OK, Status.NO_LONGER_FITS)

    @property
    def mark(self) -> str:
        return "ok" if self is Status.OK else self.value.replace("_", " ").upper()


@dataclass(frozen=True)
class Tolerance:
    """Fractions: slower than `speed`, or heavier than `memory`, is outside tolerance."""

    speed: float
    memory: float


@dataclass(frozen=True)
class Rule:
    """When checks outside tolerance make a regression. Between fresh processes a launch-bound config
    moves by 9-13% on an H200 and more on a loaded CPU: one check outside is not enough evidence."""

    consecutive: int = CONSECUTIVE
    """Checks in a row outside tolerance (against one baseline, this one included) that make a regression."""
    severe: float | None = SEVERE
    """A check worse than this many tolerances is a regression at once; None: never at once."""
    memory_exact: bool = False
    """The peak is a GPU allocator's exact figure: heavier beyond tolerance fails at once."""

    def needed(self, figure: str) -> int:
        """Checks in a row outside tolerance that make `figure` ("speed" or "memory") a regression."""
        return 1 if figure == "memory" and self.memory_exact else self.consecutive

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def default_memory_tolerance(target: Target) -> float:
    return MEMORY_TOLERANCE_GPU if target.device == "cuda" else MEMORY_TOLERANCE_CPU


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
    peaks: tuple[int, ...] = ()
    """The peak of each fitting run that counts for memory (`combine`)."""
    slowdowns: tuple[float, ...] = ()
    """The slowdown each fitting run's waits for a CPU can explain (`cpu_wait_slowdown`)."""


@dataclass(frozen=True)
class Check:
    """One re-probed configuration against its baseline."""

    name: str
    config: dict[str, Value]
    """`TrialConfig.to_dict()`: as the history and --json store it."""
    baseline_tokens_per_s: float
    baseline_peak_bytes: int
    tokens_per_s: float | None
    peak_bytes: int | None
    outcome: str
    attempts: int
    status: Status
    runs: tuple[float, ...]
    messages: tuple[str, ...]
    peaks: tuple[int, ...] = ()
    streak: int = 0
    """Checks in a row, this one included, with the deciding figure outside tolerance against this
    baseline."""
    slowdowns: tuple[float, ...] = ()
    """The slowdown each run's waits for a CPU can explain (1.0: none)."""
    results: tuple[ProbeResult, ...] = field(default=(), compare=False, repr=False)
    """Tonight's runs as measured (not stored in the history: `--update-baseline` takes them in)."""

    @property
    def failed(self) -> bool:
        return self.status.failed()

    def to_dict(self) -> dict[str, object]:
        d = asdict(replace(self, results=()))
        del d["results"]
        d["status"] = self.status.value
        d["runs"], d["peaks"], d["messages"] = list(self.runs), list(self.peaks), list(self.messages)
        d["slowdowns"] = list(self.slowdowns)
        return d


@dataclass(frozen=True)
class Plan:
    """What a regress job measures, where, against what."""

    run_dir: Path
    run_id: str
    model: ModelSource
    probe: ProbeSettings
    """The search's probe settings (warm-up, timed steps, timeout) from spec.yaml."""
    best: Best
    configs: tuple[BestEntry, ...]
    target: Target
    env_before: Env
    dataset: DatasetRef | None = None
    """The data the search measured on (spec.yaml), checked unchanged; None: random tokens."""


# --------------------------------------------------------------------------- what to check, where


def plan(run_dir: Path, top: int, gpu: str | None = None, device: str | None = None,
         memory_limit: str | None = None, allow_gpu_change: bool = False, dataset: str | None = None) -> Plan:
    """Read the run's baseline and choose the target; bad flags or files are one UsageError."""
    if top < 1:
        raise UsageError("--top: at least 1 (the winner).")
    spec = load_spec(run_dir)
    best = read_best(run_dir)
    configs = best.entries[:top]
    need = max(c.config.gpus for c in configs)
    stored = spec.targets[0]
    check_attached(run_dir, configs, stored, gpu, device)
    target = choose_target(stored, gpu, device, memory_limit, per_probe=need)
    check_gpu(best.target, target, allow_gpu_change)
    ref = stored_dataset(spec.dataset, dataset, "the baseline was measured on", "this is not a regression: ")
    return Plan(run_dir, spec.run_id, spec.model, spec.probe, best, configs, target, read_env(run_dir), ref)


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
    here = (f"--gpu {gpu} names {attached}" if gpu is not None
            else f"{attached} {'is' if attached == 1 else 'are'} attached here")
    first = configs.index(need)
    fewer = f", or --top {first} to check only the configs before it" if first else ""
    raise UsageError(f"RUN: {run_dir}: the {need.name} was measured on {n} GPUs (gpus={n}) and {here}: a "
                     f"probe spans as many GPUs as it was stored with. Run `autofit regress` on a host with "
                     f"{n} GPUs of the baseline's model (--gpu with {n} indices to choose them){fewer}.")


def check_gpu(measured_on: JSONObject, target: Target, allow_change: bool) -> None:
    was = measured_on.get("gpu_name") if measured_on.get("device") == "cuda" else "cpu"
    now = target.gpu_name if target.device == "cuda" else "cpu"
    if was != now and not allow_change:
        raise UsageError(f"the baseline was measured on {was}, this check would run on {now}: figures from "
                         "different GPUs are not comparable. Run on the baseline's GPU model, or pass "
                         "--allow-gpu-change (and then --update-baseline) to start a new baseline.")


def now_env() -> Env:
    return collect()


def version_diff(before: Env, now: Env) -> list[tuple[str, str, str, bool]]:
    """(what, baseline, now, changed) for GPU, driver, CUDA and each package."""
    def gpu(env: Env) -> str:
        return ", ".join(sorted({g["name"] for g in env.get("gpus", [])})) or "none"

    def text(env: Env, key: str) -> str:
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
    """What tonight's figures alone say, before the history is asked: ok, faster, slower, heavier, or
    no longer fits. It decides whether a config is measured again (`check_config`)."""
    if not m.fits:
        return Status.NO_LONGER_FITS
    speed, memory = figures(base, m, tol)
    if speed.outside():
        return Status.SLOWER
    if memory.outside():
        return Status.HEAVIER
    return Status.FASTER if speed.better() > tol.speed else Status.OK


@dataclass(frozen=True)
class Figure:
    """One figure of a check (tokens/s or the peak) against its baseline."""

    name: str
    """Which figure: "speed" or "memory"."""
    now: float
    base: float
    tolerance: float
    values: tuple[float, ...] = ()
    """The figure of each run (empty for a recorded check: only its combined figure counts)."""
    explained: float = 1.0
    """Speed: the slowdown the median run's waits for a CPU can explain (1.0: none, or not read)."""

    @property
    def regression(self) -> Status:
        return Status.SLOWER if self.name == "speed" else Status.HEAVIER

    def worse(self) -> float:
        """How much worse than the baseline, as a fraction of it: slower by (1 - now/base), heavier by
        (now/base - 1); negative when better."""
        ratio = self.now / self.base
        return 1 - ratio if self.name == "speed" else ratio - 1

    def better(self) -> float:
        return -self.worse()

    def outside(self) -> bool:
        """Worse than the baseline beyond the tolerance."""
        return self.worse() > self.tolerance

    def spread(self) -> float:
        return spread(self.values)

    def distance(self) -> float:
        """Tonight against the baseline on the same scale: the larger over the smaller (1.0 when equal)."""
        low = min(self.now, self.base)
        return max(self.now, self.base) / low if low > 0 else math.inf

    def noisy(self) -> bool:
        """The runs disagree among themselves at least as much as tonight's figure differs from the
        baseline (so, tonight's figure being outside tolerance, by more than the tolerance): noise that
        large can make the difference by itself. A gap wider than the whole spread is no such noise."""
        return self.spread() >= self.distance()

    def contended(self) -> bool:
        """Slower by no more than the runs' waits for a CPU explain: other processes on the machine's cores
        can make the difference by themselves."""
        return self.name == "speed" and self.worse() > 0 and self.explained >= self.distance()


def spread(values: Sequence[float]) -> float:
    """How much the runs disagree: the largest over the smallest (1.0 for one run)."""
    return max(values) / min(values) if values and min(values) > 0 else 1.0


def figures(base: BestEntry, m: Measured, tol: Tolerance) -> tuple[Figure, Figure]:
    """Tonight's speed and memory against the baseline (a config that fits)."""
    return (Figure("speed", m.tokens_per_s or 0.0, base.tokens_per_s, tol.speed, m.runs,
                   statistics.median(m.slowdowns) if m.slowdowns else 1.0),
            Figure("memory", m.peak_bytes or 0, base.peak_memory_bytes, tol.memory,
                   tuple(map(float, m.peaks))))


def recorded_figure(check: JSONObject, name: str, tol: Tolerance) -> Figure | None:
    """A figure of a check in the history (today's tolerance); None where that check did not fit."""
    now = check.get("tokens_per_s" if name == "speed" else "peak_bytes")
    if check.get("status") == Status.NO_LONGER_FITS.value or not now:
        return None
    if name == "speed":
        return Figure(name, now, check["baseline_tokens_per_s"], tol.speed)
    return Figure(name, now, check["baseline_peak_bytes"], tol.memory)


def streak(base: BestEntry, history: Sequence[HistoryRecord], name: str, tol: Tolerance) -> int:
    """Checks in a row, ending with the last one recorded, in which this config's figure `name` was
    outside today's tolerance against this same baseline (a check that did not fit counts as outside).
    A re-baselined config starts again: the checks before measured against other figures."""
    same = [c for entry in history for c in entry["checks"]
            if c["name"] == base.name and c["baseline_tokens_per_s"] == base.tokens_per_s
            and c["baseline_peak_bytes"] == base.peak_memory_bytes]
    n = 0
    for check in reversed(same):
        f = recorded_figure(check, name, tol)
        if f is not None and not f.outside():
            break
        n += 1
    return n


@dataclass(frozen=True)
class Verdict:
    """What `decide` found: the status, the figure that decided it, and the checks in a row outside."""

    status: Status
    figure: Figure | None = None
    streak: int = 0


def decide(base: BestEntry, history: Sequence[HistoryRecord], m: Measured, tol: Tolerance,
           rule: Rule = Rule()) -> Verdict:
    """The verdict on tonight's runs of `base`, given the history of earlier checks (oldest first).

    A config that no longer fits is a regression. A figure worse than tolerance is: inconclusive when
    its runs are too noisy to judge (`Figure.noisy`), or slower by no more than their waits for a CPU explain
    (`Figure.contended`: a busy machine), whatever else holds; a regression when it is
    worse than `rule.severe` tolerances, or outside on `rule.needed` checks in a row; else suspect.
    Faster beyond tolerance is "faster" (inconclusive when noisy); anything else is ok."""
    if not m.fits:
        return Verdict(Status.NO_LONGER_FITS)
    found = []
    speed, memory = figures(base, m, tol)
    for f in (speed, memory):
        if not f.outside():
            continue
        nights = 1 + streak(base, history, f.name, tol)
        severe = rule.severe is not None and f.worse() > rule.severe * f.tolerance
        if f.noisy() or f.contended():
            found.append(Verdict(Status.INCONCLUSIVE, f, nights))
        elif severe or nights >= rule.needed(f.name):
            found.append(Verdict(f.regression, f, nights))
        else:
            found.append(Verdict(Status.SUSPECT, f, nights))
    if found:  # a regression first, then a suspect figure, then a noisy one
        return min(found, key=lambda v: (not v.status.failed(), v.status is Status.INCONCLUSIVE))
    if speed.better() > tol.speed:
        return Verdict(Status.INCONCLUSIVE if speed.noisy() else Status.FASTER, speed)
    return Verdict(Status.OK)


def combine(results: Sequence[ProbeResult]) -> Measured:
    """The search's rule for repeats: tokens/s the median of the fitting runs, the peak the largest;
    a run out of memory (or no fitting run at all) means the config no longer fits. Other failures
    of a repeat (a crash, a timeout) are not counted."""
    fits = [r for r in results if r.outcome.is_fit() and r.tokens_per_s]
    runs = tuple(r.tokens_per_s or 0.0 for r in fits)
    failed = [r for r in results if r.outcome.is_memory()] or ([] if fits else list(results))
    if failed:
        return Measured(False, None, failed[0].peak_memory_bytes, failed[0].outcome.value, failed[0].reason,
                        runs)
    clean = [r for r in fits if not ran_checks(r)] or fits  # a check's residue is not the config's memory
    peaks = tuple(r.peak_memory_bytes for r in clean if r.peak_memory_bytes)
    return Measured(True, combined_tokens_per_s(list(runs)), max(peaks, default=0) or None,
                    fits[0].outcome.value, "", runs, peaks, tuple(cpu_wait_slowdown(r) for r in fits))


def cpu_wait_slowdown(r: ProbeResult) -> float:
    """The slowdown the run's waits for a CPU can explain: over its timed steps, (time its threads waited for
    a CPU + their CPU time) / their CPU time, from hostclock's `run_wait_s` and `process_cpu_s` (1.0 where the
    host did not give them). Threads kept waiting half the time they were ready ran at most half as fast."""
    host = r.extra.get("host_per_step")
    if not isinstance(host, dict):
        return 1.0

    def total(key: str) -> float:
        return sum(x for x in host.get(key) or [] if isinstance(x, (int, float)))

    cpu = total("process_cpu_s")
    return (total("run_wait_s") + cpu) / cpu if cpu > 0 else 1.0


def ran_checks(r: ProbeResult) -> bool:
    """The probe ran a correctness check before training (the kernel gate, the batching check): on the
    CPU the memory the check freed stays resident and counts in its peak."""
    return r.checked


def check_config(base: BestEntry, measure: Callable[[int], ProbeResult], tol: Tolerance, rule: Rule = Rule(),
                 history: Sequence[HistoryRecord] = ()) -> Check:
    """Measure once; outside tolerance, measure until there are RUNS_OUTSIDE_TOLERANCE runs, then decide."""
    results = [measure(1)]
    if not judge(base, combine(results), tol).settled():
        results += [measure(n) for n in range(2, RUNS_OUTSIDE_TOLERANCE + 1)]
    return settle(base, results, tol, rule, history)


def settle(base: BestEntry, results: Sequence[ProbeResult], tol: Tolerance, rule: Rule = Rule(),
           history: Sequence[HistoryRecord] = ()) -> Check:
    """The check of `base` from its runs and the history before them."""
    m = combine(results)
    v = decide(base, history, m, tol, rule)
    check = Check(base.name, base.config.to_dict(), base.tokens_per_s, base.peak_memory_bytes, m.tokens_per_s,
                  m.peak_bytes, m.outcome, len(results), v.status, m.runs, (), m.peaks, v.streak, m.slowdowns,
                  tuple(results))
    return replace(check, messages=describe(check, m, tol, rule, v))


def describe(c: Check, m: Measured, tol: Tolerance, rule: Rule, v: Verdict) -> tuple[str, ...]:
    if c.status is Status.NO_LONGER_FITS:
        line = (f"{c.name} no longer fits: outcome {m.outcome} ({m.reason}); baseline "
                f"{c.baseline_tokens_per_s:,.0f} tokens/s at {format_size(c.baseline_peak_bytes)}")
        return (line,)
    dt = (c.tokens_per_s or 0) / c.baseline_tokens_per_s - 1
    dm = (c.peak_bytes or 0) / c.baseline_peak_bytes - 1
    runs = f"median of {len(c.runs)} runs (spread {spread(c.runs) - 1:.0%})" if len(c.runs) > 1 else "1 run"
    line = (f"{c.name}: {c.tokens_per_s:,.0f} tokens/s vs baseline {c.baseline_tokens_per_s:,.0f} "
            f"({dt:+.1%}, tolerance {tol.speed:.0%}); peak {format_size(c.peak_bytes)} vs "
            f"{format_size(c.baseline_peak_bytes)} ({dm:+.1%}, tolerance {tol.memory:.0%}); {runs}")
    why = reason(c.name, v, rule)
    return (line, why) if why else (line,)


def reason(name: str, v: Verdict, rule: Rule) -> str:
    """Why a check is what it is, in one line (none for ok)."""
    if v.status is Status.FASTER:
        return (f"{name} is faster than its baseline beyond tolerance: re-baseline by running this "
                "command again with --update-baseline")
    f = v.figure
    if f is None:
        return ""
    worse = f.worse()
    side = ("slower", "faster") if f.name == "speed" else ("heavier", "lighter")
    what = f"{side[0] if worse > 0 else side[1]} by {abs(worse):.1%}"
    if v.status is Status.INCONCLUSIVE:
        figure = "tokens/s" if f.name == "speed" else "peak"
        if f.contended():
            why = (f"its runs waited for a CPU (other processes on this machine's cores) long enough to run "
                   f"{f.explained:.2f}x slower, as much as tonight's tokens/s differs from the baseline "
                   f"({f.distance():.2f}x)")
        else:
            why = (f"its runs differ {f.spread():.2f}x among themselves, as much as tonight's {figure} differs "
                   f"from the baseline ({f.distance():.2f}x)")
        return (f"{name} is inconclusive: {what}, but {why}: too noisy to judge, and not a regression on this "
                "evidence. Measure again on an idle machine.")
    in_a_row = f"{v.streak} check{'' if v.streak == 1 else 's'} in a row"
    needed = rule.needed(f.name)
    if v.status is Status.SUSPECT:
        at_once = ("" if rule.severe is None else
                   f", or one check worse than {rule.severe:g} times the tolerance "
                   f"({rule.severe * f.tolerance:.0%}, --severe-factor)")
        return (f"{name} is suspect: {what}, outside the tolerance ({f.tolerance:.0%}) on {in_a_row}; "
                f"{needed} in a row make a regression (--consecutive){at_once}. Not failed: the next check "
                "decides.")
    if rule.severe is not None and worse > rule.severe * f.tolerance:
        return (f"{name} is {what}, worse than {rule.severe:g} times the tolerance "
                f"({rule.severe * f.tolerance:.0%}): a regression at once")
    if f.name == "memory" and rule.memory_exact:
        return (f"{name} is {what}, outside the tolerance ({f.tolerance:.0%}): the GPU allocator's peak is "
                "exact, so one check is a regression")
    return (f"{name} is {what}, outside the tolerance ({f.tolerance:.0%}) on {in_a_row} (--consecutive "
            f"{needed}): a regression")


# --------------------------------------------------------------------------- measuring


def run_checks(p: Plan, tol: Tolerance, rule: Rule = Rule(), history: Sequence[HistoryRecord] = (),
               on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Re-probe each baseline config in fresh probe processes, with the search's probe settings, and
    decide each against the history before tonight."""
    checks = []
    with Runner(p.target, p.run_dir / "logs", standby=1,
                warmup_steps=p.probe.warmup_steps, timed_steps=p.probe.timed_steps,
                max_probe_accumulation=p.probe.max_probe_accumulation,
                dataset=p.dataset.to_dict() if p.dataset else None, data_cache=p.run_dir / "data") as runner:
        for i, base in enumerate(p.configs):
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")

            def measure(attempt: int, base: BestEntry = base, i: int = i, stamp: str = stamp) -> ProbeResult:
                # every correctness check in the first run (a nightly run must catch a kernel or a strategy
                # that broke); the runs that settle a figure outside tolerance train only
                checks = Checks() if attempt == 1 else Checks(gate=False, boundaries=False)
                return runner.run(base.config, p.model, name=f"regress-{stamp}-{i}-{attempt}",
                                  timeout=p.probe.timeout_s, checks=checks)

            checks.append(check_config(base, measure, tol, rule, history))
            if on_check:
                on_check(checks[-1])
    return checks


# --------------------------------------------------------------------------- what is written


def verdict(checks: Sequence[Check]) -> str:
    """The job's verdict: "regression", else "suspect", else "inconclusive", else "pass"."""
    if any(c.failed for c in checks):
        return "regression"
    for status in (Status.SUSPECT, Status.INCONCLUSIVE):
        if any(c.status is status for c in checks):
            return str(status.value)
    return "pass"


def summary(p: Plan, checks: Sequence[Check], tol: Tolerance, rule: Rule, env_now: Env) -> dict[str, object]:
    """The --json document."""
    return {"run": str(p.run_dir), "target": p.target.describe(), "tolerance": tol.speed,
            "memory_tolerance": tol.memory, "rule": rule.to_dict(), "verdict": verdict(checks),
            "regression": any(c.failed for c in checks), "error": None,
            "checks": [c.to_dict() for c in checks],
            "versions": [{"what": w, "baseline": b, "now": n, "changed": ch}
                         for w, b, n, ch in version_diff(p.env_before, env_now)]}


def junit_xml(checks: Sequence[Check], suite: str) -> str:
    """One test case per config: a regression is a <failure> of its type; a suspect or inconclusive
    check a <skipped> with the reason (CI reports show it apart, and do not fail the job on it)."""
    root = ET.Element("testsuite", name=suite, tests=str(len(checks)),
                      failures=str(sum(c.failed for c in checks)), errors="0",
                      skipped=str(sum(c.status.doubtful() for c in checks)))
    for c in checks:
        case = ET.SubElement(root, "testcase", classname="autofit.run.regress", name=c.name)
        message = f"{c.status.value}: " + "; ".join(c.messages)[:500]
        if c.failed:
            ET.SubElement(case, "failure", message=message,
                          type=c.status.value).text = json.dumps(c.to_dict(), indent=1)
        elif c.status.doubtful():
            ET.SubElement(case, "skipped", message=message,
                          type=c.status.value).text = json.dumps(c.to_dict(), indent=1)
        else:
            ET.SubElement(case, "system-out").text = "; ".join(c.messages)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def junit_error(suite: str, message: str, kind: str) -> str:
    """The job could not check anything (bad input, a file it cannot read, or it never finished):
    one test case with an <error>, which CI shows apart from a regression's <failure>."""
    root = ET.Element("testsuite", name=suite, tests="1", failures="0", errors="1")
    case = ET.SubElement(root, "testcase", classname="autofit.run.regress", name="regress")
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
        A path that cannot be written is an error naming its flag (CannotWrite for a full or read-only
        disk, else a UsageError); the other file still gets the error."""
        reports = cls(Path(json_path) if json_path else None, Path(junit_path) if junit_path else None, run)
        clashes = reports.clashes()
        if clashes:  # refused; a report path that is not one of them still says why
            error = UsageError([message for _, message in clashes])
            flags = {flag for flag, _ in clashes}
            replace(reports, json_path=None if "--json" in flags else reports.json_path,
                    junit_path=None if "--junit" in flags else reports.junit_path).error(error)
            raise error
        problems: list[str] = []
        refused = False
        for flag, path in (("--json", reports.json_path), ("--junit", reports.junit_path)):
            if path is not None:
                try:
                    # what is there: a folder, a symlink loop (a FIFO is written into)
                    if os.path.lexists(path):
                        output_file(path, flag, "Give a file path.")
                    write_text(path, reports.error_text(path, NOT_FINISHED, "NotFinished"), flag)
                except (UsageError, CannotWrite) as e:
                    problems.append(str(e))
                    refused |= isinstance(e, CannotWrite)
        if problems:
            failure: AutofitError = CannotWrite("\n".join(problems)) if refused else UsageError(problems)
            reports.error(failure)
            raise failure
        return reports

    def clashes(self) -> list[tuple[str, str]]:
        """(flag, problem) for each path that would replace what the job reads or writes itself: the run
        folder's own files (its study, best.json; the history and the trend plot even before the first
        job), one file for both reports, or '-' (stdout holds the report lines)."""
        out = []
        run = Path(self.run)
        written = {real(run / HISTORY), real(run / TREND)}
        for flag, path in (("--json", self.json_path), ("--junit", self.junit_path)):
            if path is None:
                continue
            if str(path) == "-":
                out.append((flag, f"{flag}: '-' would mix the file into the report printed on stdout; give a "
                                  "file path."))
            elif real(path) in written or (os.path.exists(path) and RunDir(run).owns(path)):
                out.append((flag, f"{flag}: {path} is a file of the run folder {self.run} (the run's own "
                                  "record); give a path outside it, or a new file name."))
        if self.json_path and self.junit_path and real(self.json_path) == real(self.junit_path):
            out.append(("--junit", f"--json and --junit both name {self.json_path}; give two paths."))
        return out

    def error_text(self, path: Path, message: str, kind: str) -> str:
        if path == self.junit_path:
            return junit_error(self.suite, message, kind)
        return json.dumps({"run": self.run, "verdict": None, "regression": None, "error": message,
                           "error_type": kind, "checks": []}, indent=1) + "\n"

    def error(self, e: Exception) -> None:
        """Replace what can still be written with the error that stopped the job (never raises)."""
        for path in (self.json_path, self.junit_path):
            if path is not None:
                try:
                    write_atomic(path, self.error_text(path, str(e), type(e).__name__))
                except OSError:
                    pass  # the claim already named this path; the error itself is what the user sees

    def write(self, doc: dict[str, object], checks: Sequence[Check]) -> None:
        """The checks, once measured: a file that cannot be written now is exit 4 (the claim wrote it)."""
        if self.json_path is not None:
            write_text(self.json_path, json.dumps(doc, indent=1) + "\n", "--json", CannotWrite)
        if self.junit_path is not None:
            write_text(self.junit_path, junit_xml(checks, self.suite), "--junit", CannotWrite)


def real(path: Path) -> Path:
    """Where `path` leads, following links as far as they go (a symlink loop is no error here)."""
    return Path(os.path.realpath(path))


def write_text(path: Path, text: str, flag: str, error: type[AutofitError] | None = None) -> None:
    """A report file, whole or not at all. A full or read-only disk is CannotWrite (exit 4); a path that
    is no place for a file (a missing folder, a file for a folder) a UsageError, unless `error` says."""
    try:
        write_atomic(path, text)
    except OSError as e:
        refused = cannot_write(e)
        remedy = "give a path in a writable folder" + (" with free space" if refused else "")
        kind = error or (CannotWrite if refused else UsageError)
        raise kind(f"{flag}: cannot write {path} ({e.strerror}); {remedy}.") from None


def one_at_a_time(run_dir: Path, say: Callable[[str], None]) -> AbstractContextManager[None]:
    """Hold the run's regress lock while measuring and recording. Two regress jobs of one run (a nightly
    job that overran into the next) would each measure under the other's load and append to one history:
    the second waits for the first."""
    return locks.held(run_dir / REGRESS_LOCK, lambda who: say(
        f"another autofit regress of this run is measuring ({who}); waiting for it to finish, so that "
        "neither measures under the other's load (Ctrl-C to stop)"))


def append_history(run_dir: Path, checks: Sequence[Check], env: Env, limit: int | None,
                   tol: Tolerance | None = None, rule: Rule | None = None) -> HistoryRecord:
    """Append tonight's record on a line of its own (a line cut short before stays as it was, apart)."""
    entry = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "gpu": ", ".join(g["name"] for g in env.get("gpus", [])) or "cpu",
             "driver": env.get("driver"), "packages": env.get("packages"), "memory_limit_bytes": limit,
             "tolerance": asdict(tol) if tol else None, "rule": rule.to_dict() if rule else None,
             "checks": [c.to_dict() for c in checks]}
    try:
        append_line(run_dir / HISTORY, json.dumps(entry))
    except OSError as e:
        raise CannotWrite(f"RUN: cannot append to {shown(run_dir / HISTORY)} ({e.strerror}); the checks are "
                          "in the output above (and in --json where given).") from None
    return entry


RECORD_FIELDS = {"name": (str,), "baseline_tokens_per_s": (int, float), "baseline_peak_bytes": (int, float),
                 "tokens_per_s": (int, float, type(None)), "peak_bytes": (int, float, type(None)),
                 "status": (str,)}
"""What each check of a history record must hold, and of which JSON types, for the rule and the plot."""


def read_history(run_dir: Path, warn: Callable[[str], None] = lambda _: None) -> list[HistoryRecord]:
    """Records of the history, oldest first. A damaged line (a write cut short, an edit) is skipped
    with a warning naming the file and the line; the records around it are read. A history or trend
    plot that is not a regular file (a folder, a FIFO, a symlink loop) is a UsageError, before anything
    is measured: appending to a FIFO, or drawing into one, would wait for a reader that never comes."""
    for name, then in ((TREND, "regress draws a new one"), (HISTORY, "regress starts a new history")):
        if os.path.lexists(run_dir / name):
            input_file(run_dir / name, "RUN", f"Move it out of the run folder; {then}.")
    path = run_dir / HISTORY
    if not path.is_file():
        return []
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise UsageError(f"RUN: cannot read {shown(path)} ({e.strerror}); make it readable, or move it out "
                         "of the run folder.") from None
    out = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode())
            problem = record_problem(entry)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, a number too long, nested too deep
            problem = f"not JSON: {getattr(e, 'msg', None) or e}"
        if problem:
            warn(f"RUN: {shown(path)} line {number} is damaged ({problem}); skipped, the other records are "
                 "read")
        else:
            out.append(entry)
    return out


def record_problem(entry: object) -> str:
    """What keeps a parsed line from being a history record ("" for a record)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("checks"), list) \
            or not isinstance(entry.get("date"), str):
        return "not a regress record: no date and list of checks"
    for check in entry["checks"]:
        bad = [k for k, types in RECORD_FIELDS.items() if not isinstance(check, dict) or k not in check
               or not isinstance(check[k], types) or isinstance(check[k], bool)]
        if bad:
            return f"a check without {', '.join(bad)}"
        if any(isinstance(check[k], float) and not math.isfinite(check[k]) for k in RECORD_FIELDS):
            return "a check with a figure that is not a finite number"
        if check["baseline_tokens_per_s"] <= 0 or check["baseline_peak_bytes"] <= 0:
            return "a check with a baseline that is not positive"
    return ""


def plot_trend(run_dir: Path, history: Sequence[HistoryRecord]) -> Path:
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
    try:
        save_figure(fig, path)
    except OSError as e:
        raise CannotWrite(f"RUN: cannot write the trend plot {shown(path)} ({e.strerror}); the checks are in "
                          f"{shown(run_dir / HISTORY)}.") from None
    finally:
        plt.close(fig)
    return path


def record(p: Plan, checks: Sequence[Check], tol: Tolerance, rule: Rule, env_now: Env,
           reports: Reports, history: Sequence[HistoryRecord] = ()) -> Path:
    """The history, --json and --junit (both written even when the history cannot be), the trend plot
    (of the records read before tonight and tonight's)."""
    try:
        entry = append_history(p.run_dir, checks, env_now, p.target.memory_limit_bytes, tol, rule)
    finally:
        reports.write(summary(p, checks, tol, rule, env_now), checks)
    return plot_trend(p.run_dir, [*history, entry])


# --------------------------------------------------------------------------- re-baselining


def measured(c: Check) -> JSONObject:
    """A check's runs as a best.json entry's measured fields: the first fitting run's whole result (its steps,
    versions and log), the runs combined as the search combines repeats, tokens/s and the peak the check's.
    Only the figures would leave the old steps, spread and runs beside them."""
    fits = [r for r in c.results if r.outcome.is_fit() and r.tokens_per_s]
    if not fits:  # a check rebuilt without its runs: its figures alone
        return {"tokens_per_s": c.tokens_per_s, "peak_memory_bytes": c.peak_bytes}
    first = ProbeResult.from_dict(fits[0].to_dict())  # a copy: merge_repeats edits it
    res = merge_repeats(first, [r.to_dict() for r in fits[1:]])
    res.tokens_per_s, res.peak_memory_bytes = c.tokens_per_s, c.peak_bytes
    return res.to_dict()


def taken_in(checks: Sequence[Check]) -> str:
    """What a new baseline takes in that a nightly job should not accept silently ("" for nothing):
    a regression, or figures outside tolerance not yet called one (an inconclusive check's are not taken in)."""
    worse = [f"{c.name} {c.status.value}" for c in checks
             if c.failed or (c.status.doubtful() and c.status is not Status.INCONCLUSIVE)]
    if not worse:
        return ""
    what = "a regression" if any(c.failed for c in checks) else "figures outside the tolerance"
    return f"the new baseline takes in {what} ({', '.join(worse)}); drop --update-baseline from a nightly job"


def update_baseline(p: Plan, checks: Sequence[Check], env: Env) -> Path | None:
    """Rewrite best.json (and env.json) with the new measurements; keep the previous ones beside them, each
    file whole or not at all. A config that no longer fits is not a baseline: RegressionFound, nothing
    rewritten. An inconclusive check keeps its old baseline (its runs are no figure); None where every
    check is inconclusive (nothing rewritten)."""
    if any(c.status is Status.NO_LONGER_FITS for c in checks):
        raise RegressionFound("a baseline config no longer fits; not re-baselining. Search again.")
    if all(c.status is Status.INCONCLUSIVE for c in checks):
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kept = p.run_dir / f"best.previous-{stamp}.json"
    best = json.loads(json.dumps(p.best.doc))  # a copy to edit
    entries = [best, *best.get("runners_up", [])]
    for entry, c in zip(entries, checks):
        if c.status is not Status.INCONCLUSIVE:
            entry.update(measured(c))
    best["baseline_updated"] = stamp
    env_path = p.run_dir / "env.json"
    steps: list[tuple[Path, Callable[[Path], None]]] = [
        (kept, lambda to: write_atomic(to, p.best.path.read_bytes()))]
    if env_path.is_file():
        steps.append((p.run_dir / f"env.previous-{stamp}.json",
                      lambda to: write_atomic(to, env_path.read_bytes())))
    steps += [(p.best.path, lambda to: write_json(to, best)), (env_path, lambda to: write_json(to, env))]
    for path, write in steps:  # the new best.json only once the old one is kept; env.json last
        try:
            write(path)
        except OSError as e:
            done = ("best.json is rewritten, env.json is not; " if path == env_path
                    else "nothing was rewritten; ")
            raise CannotWrite(f"RUN: cannot re-baseline {shown(p.run_dir)}: cannot write {shown(path)} "
                              f"({e.strerror}); {done}the checks are in "
                              f"{shown(p.run_dir / HISTORY)}.") from None
    return kept
