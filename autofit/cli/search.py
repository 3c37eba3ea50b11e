"""`autofit search`: the fastest configuration that fits, with live progress.

Parsing and printing only: what to start, resume or join, and how, is `session.py`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack, suppress
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from autofit.cli.common import (
    EXIT_CODES,
    CommaList,
    Formatter,
    Subcommands,
    add_data_flags,
    add_probe_flags,
    add_target_flags,
    data_fields,
    probe_settings,
    warn,
)
from autofit.config.space import shipped_spaces
from autofit.core.errors import UsageError
from autofit.core.paths import shown
from autofit.core.units import bare_seconds, format_duration, format_size
from autofit.protocol.request import TRAIN_TOKENS
from autofit.run import locks
from autofit.run.report.lines import config_brief, export_command
from autofit.run.report.markdown import untried_line
from autofit.run.rundir import CONFIRM, REGRESS_LOCK, SEARCH_LOCK, RunDir
from autofit.run.session import (
    Mode,
    SearchRequest,
    Session,
    StartInterrupted,
    Summary,
    busy_gpus,
    nothing_fits,
    plan,
    start,
    summarize,
)
from autofit.run.session import run as run_search
from autofit.search.driver import BUDGET_CUT, Event
from autofit.search.policy import Policy

if TYPE_CHECKING:
    import optuna

WIDE = 110
"""Terminal columns from which the table shows the predicted peak and the worker."""
COLUMNS = ("#", "config", "outcome", "tok/s", "peak", "predicted", "worker")


class Progress:
    """A live table of probes on a terminal (fitted to its width); one plain line per probe otherwise."""

    def __init__(self, enabled: bool, budget_s: float = 0.0) -> None:
        self.console = Console(highlight=False)
        self.tty = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self.rows: list[tuple[str, ...]] = []
        self.workers: set[str] = set()
        self.best = ""
        self.left = budget_s
        """The budget left as of the last event (the whole budget before the first)."""
        self.live: Live | None = None

    def __enter__(self) -> Progress:  # noqa: PYI034  (Self needs Python 3.11)
        if self.tty:
            self.live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.live is not None:
            self.live.__exit__(kind, exc, tb)

    def _table(self) -> Table:
        """The config column takes what the others leave and is cut with an ellipsis: one line a row."""
        wide = self.console.width >= WIDE
        t = Table(title=f"best: {self.best or '-'}  left: {format_duration(self.left)}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
        columns = ["#", "outcome", "tok/s", "peak", "config"]
        if wide:
            columns.insert(4, "predicted")
        if wide and len(self.workers) > 1:
            columns.append("worker")
        visible = [dict(zip(COLUMNS, row)) for row in self.rows[-25:]]
        widths = {c: max([len(c)] + [len(r[c]) for r in visible]) for c in columns}
        widths["config"] = max(20, self.console.width - sum(widths[c] + 3 for c in columns
                                                            if c != "config") - 3)
        for col in columns:
            t.add_column(col, no_wrap=True, overflow="ellipsis", min_width=widths[col], max_width=widths[col],
                         justify="right" if col in ("#", "tok/s", "peak", "predicted") else "left")
        for r in visible:
            t.add_row(*(r[c] for c in columns))
        return t

    def __call__(self, e: Event) -> None:
        r = e.result
        outcome = (r.outcome.value + (" (again)" if e.kind == "again" else "")) if r else f"skip: {e.kind}"
        tps = f"{r.tokens_per_s:,.0f}" if r and r.tokens_per_s else "-"
        if r and e.kind == "again" and len(r.measurements) > 1:
            # the repeat's own figure in its column; the median of the runs, which the config now ranks
            # by, beside
            tps = f"{r.measurements[-1]:,.0f}"
            outcome = f"{r.outcome.value} (again; median {r.tokens_per_s:,.0f})"
        if r and BUDGET_CUT in r.extra:
            outcome = "cut: budget"  # not a timeout of the config: --resume probes it again
        peak = format_size(r.peak_memory_bytes) if r else "-"
        row = (str(e.number), config_brief(e.config), outcome, tps, peak, format_size(e.predicted), e.worker)
        if e.best is not None:
            self.best = f"{e.best.tokens_per_s:,.0f} tokens/s ({config_brief(e.best.config)})"
        self.left = e.seconds_left
        self.workers.add(e.worker)
        if not self.enabled or (r is None and not self.tty):
            return
        self.rows.append(row)
        if self.live is not None:
            self.live.update(self._table())
        else:
            print(f"#{row[0]:>3} {row[2]:<11} {tps:>9} tok/s  peak {peak:>9} (pred {row[5]})  {row[1]}  "
                  f"[left {format_duration(e.seconds_left)}]", flush=True)


def request(args: argparse.Namespace) -> SearchRequest:
    text_field, messages_field = data_fields(args)
    return SearchRequest(
        model=args.model, space=args.space, gpu=args.gpu, device=args.device, memory_limit=args.memory_limit,
        gpus=args.gpus, headroom=args.headroom, budget=args.budget, max_length=args.max_length,
        global_batch=args.global_batch,
        out=Path(args.out), storage=args.storage, study_name=args.study_name,
        resume=Path(args.resume) if args.resume else None, seed=args.seed, policy=args.policy,
        probe=probe_settings(args),
        dataset=args.dataset, text_field=text_field, messages_field=messages_field,
        text_mode=args.text_mode)


def cmd_search(args: argparse.Namespace) -> int:
    session = plan(request(args))
    with ExitStack() as held:  # the run folder's search lock, for the search's life
        def hold(s: Session) -> None:
            held.enter_context(locks.held(s.run_dir / SEARCH_LOCK, partial(_searching, s)))

        if session.mode is not Mode.NEW:  # before start() rewrites anything in the folder
            if session.mode is Mode.JOIN:  # a joining worker's folder is made here; a resumed one exists
                with suppress(OSError):  # not writable: start() says so, naming --out
                    session.run_dir.mkdir(parents=True, exist_ok=True)
            hold(session)
            regressing = locks.holder(session.run_dir / REGRESS_LOCK)
            if regressing:  # it measures the winner: two measurers on one machine measure each other's load
                raise UsageError(f"--resume: autofit regress is measuring {shown(session.run_dir)} "
                                 f"({regressing}); resume when it has finished.")
        try:
            session, study = start(session)
            if session.mode is Mode.NEW:  # a folder of its own (start reserves it)
                hold(session)
            return _search(args, session, study)
        except StartInterrupted as e:  # while the run folder was made
            return _interrupted(e.session)
        except KeyboardInterrupt:  # while the outputs of a search were written, or before it began
            return _interrupted(session)


def _searching(session: Session, who: str) -> None:
    if session.mode is Mode.JOIN:
        raise UsageError(f"a worker of this study already runs in {shown(session.run_dir)} ({who}), joined "
                         "from this folder; start another worker from another folder, or give it another "
                         "--out.")
    raise UsageError(f"--resume: a search is running in {shown(session.run_dir)} ({who}); wait for it to "
                     "end, or stop it (Ctrl-C) and resume then.")


def _search(args: argparse.Namespace, session: Session, study: optuna.Study) -> int:
    for warning in [*session.spec.space.warnings(), *busy_gpus(session.spec.targets),
                    *_short_budget(args.budget)]:
        warn(warning)
    if not args.json:
        print(_opening(session), file=sys.stderr)
    for note in session.notes:  # on stderr with --json too: stdout holds the JSON alone
        print(f"autofit: {note}", file=sys.stderr)
    with Progress(not args.json, session.spec.budget_s) as progress:
        reason, interrupted = run_search(session, progress, args.standby)
    summary = summarize(session, study, reason, interrupted)
    failure = nothing_fits(session, summary) if summary.best is None and not interrupted else None
    if args.json:
        print(json.dumps({"run_dir": str(summary.run_dir), "stop_reason": reason, "probes": len(summary.rows),
                          "skipped": summary.skipped, "untried": summary.untried, "best": summary.best,
                          "notes": list(session.notes),
                          "nothing_fits": str(failure) if failure else None}, indent=1))
    if interrupted:
        return _interrupted(session)
    if failure is not None:
        raise failure
    if not args.json:
        print(_closing(summary))
    return 0


def _interrupted(session: Session) -> int:
    """Ctrl-C, SIGTERM or SIGHUP: the probes are stopped, what was measured is in the study; the command that
    continues it, where the run folder has its spec (a search stopped before it wrote one left nothing)."""
    if RunDir(session.run_dir).spec.exists():
        print(f"autofit: interrupted; the study is saved. Continue with: autofit search --resume "
              f"{shown(session.run_dir)}", file=sys.stderr)
    else:
        print("autofit: interrupted before the run folder was made; nothing was measured.", file=sys.stderr)
    return 130


def _short_budget(budget: str | None) -> list[str]:
    """A bare number is seconds: under a minute, say so (`--budget 3` is rarely meant as 3 s)."""
    text = (budget or "").strip()
    if bare_seconds(text) and float(text) < 60:
        return [f"--budget {text}: a bare number is seconds, and {text} s is shorter than one probe; "
                f"for minutes write {text}m."]
    return []


def _opening(session: Session) -> str:
    spec = session.spec
    verb = {Mode.NEW: "searching", Mode.RESUME: "resuming", Mode.JOIN: "joining"}[session.mode]
    return (f"autofit: {verb} {spec.model.ref} on {', '.join(t.describe() for t in spec.targets)}; "
            f"space {spec.space.name} ({len(spec.space.candidates())} configs); budget "
            f"{format_duration(spec.budget_s)}; run folder {shown(session.run_dir)}")


def _closing(s: Summary) -> str:
    best = s.best or {}
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(s.skipped.items()))
    pairs = f"{best['pairs_per_s']:,.2f} pairs/s, " if best.get("pairs_per_s") else ""  # a DPO winner's objective
    return (f"\nbest: {pairs}{best['tokens_per_s']:,.0f} tokens/s, peak {format_size(best['peak_memory_bytes'])} "
            f"({config_brief(best['config'])})\nstopped: {s.stop_reason}; {len(s.rows)} "
            f"probe{'s' if len(s.rows) != 1 else ''}"
            + (f", skipped {sum(s.skipped.values())} ({skipped})" if skipped else "")
            + (f"; {untried_line(s.untried)}" if s.untried else "")
            + f"\nreport: {shown(s.run_dir / 'report.md')}\n"
            f"next:   {export_command(s.run_dir, best['config'])}")


SEARCH_EPILOG = """\
examples:
  autofit search --model tiny-llama --space cpu-demo --budget 3m     # anywhere, on the CPU without a GPU
  autofit search --model llama2-7b --gpu 0 --memory-limit 40GiB --budget 30m
  autofit search --model llama2-7b --memory-limit 24GiB --space qlora --max-length 4096,2048,1024
  autofit search --model ./my-model --gpu 0,1 --budget 1h           # one worker per GPU, one study
  autofit search --model llama2-7b --gpus 2 --memory-limit 40GiB --space distributed   # each probe spans 2 GPUs
  autofit search --resume runs/20261202T101500Z-llama2-7b            # after Ctrl-C or a crash
  autofit search --model tiny-llama --space cpu-demo --device cpu --dataset train.jsonl --max-length 256
      # --dataset: probes train on the data's micro-batches (objective: trained tokens/s); the space
      # gains `batching` (pad_max, pad_longest, group_by_length, padding_free, packed) and, without
      # --max-length, the lengths covering 100/99.9/99/95% of the samples
  # several hosts, one study (each host runs the same command):
  autofit search --model llama2-7b --storage postgresql+psycopg://user:pw@db/autofit --study-name s1

""" + EXIT_CODES  # noqa: E501  the help text as printed


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    se = sub.add_parser("search", help="find the fastest configuration that fits", formatter_class=fmt,
                        epilog=SEARCH_EPILOG)
    se.add_argument("--model", help="preset, local folder, config.json, or hub id")
    se.add_argument("--space", help="search space: a shipped one (%s) or a YAML path (default lora)"
                    % ", ".join(shipped_spaces()))
    add_target_flags(se)
    se.add_argument("--budget", default=None,
                    help="wall-clock budget for the whole search (default 30m; on --resume: the run's)")
    se.add_argument("--max-length", metavar="N", action=CommaList,
                    help="replace the space's lengths, spaced or a comma list (the longest that fits wins)")
    se.add_argument("--global-batch", metavar="N", action=CommaList,
                    help="replace the space's sequences per optimizer step (one or several)")
    se.add_argument("--out", default="runs", help="where run folders go (default runs/)")
    se.add_argument("--storage", help="Optuna storage URL shared by workers (postgresql+psycopg://..., "
                                      "sqlite:///...) or a .journal file path")
    se.add_argument("--study-name", help="study to create or join at --storage")
    se.add_argument("--resume", metavar="RUN_FOLDER",
                    help="continue a search; finished probes are not re-run")
    se.add_argument("--json", action="store_true", help="print a JSON summary (no live table)")
    se.add_argument("--seed", type=int, default=0, help="sampler seed")
    se.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.EDGE.value,
                    help="which probe comes next: edge (P(fit) x expected gain, cost-aware; default) or "
                         "promise (the first version's order, kept for comparison)")
    se.add_argument("--standby", type=int, default=None,
                    help="probe processes importing ahead of need, per worker (default: 2 on a GPU, "
                         "1 on the CPU); importing torch+transformers+peft takes 15-20 s on a GPU host")
    add_probe_flags(se, timeout_flag="--probe-timeout")
    add_data_flags(se, resumes=True)
    se.add_argument("--confirm", type=int, default=CONFIRM,
                    help="fits within 5%% of the best to measure again, in a fresh process, before one is "
                         "called the winner (its tokens/s: the median of the runs); time for one is kept "
                         "in the budget; a best that a repeat leaves unmeasured-again is measured too "
                         f"(default {CONFIRM}; 0: none)")
    se.add_argument("--train-steps", type=int, metavar="N", default=None,
                    help="the planned training length in optimizer steps instead of tokens: each config's "
                         "global batch x max_length tokens per step (with --dataset an upper bound: samples "
                         "are shorter)")
    se.add_argument("--train-tokens", type=int, metavar="N", default=None,
                    help="tokens the real training run will process: a compiled config's compile time is "
                         "amortised over them when configs are ranked, so a 90 s compile does not win a "
                         f"short job (default {TRAIN_TOKENS:,}: about 8k samples x 2048 tokens x 3 epochs)")
    se.set_defaults(func=cmd_search)
