"""`autofit search`: the fastest configuration that fits, with live progress."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import NothingFits, UsageError
from ..target import resolve_targets
from .common import add_target_flags, gather


class Progress:
    """A live table of probes on a terminal; one plain line per probe otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.tty = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self.rows: list[tuple[str, ...]] = []
        self.best = ""
        self.left = 0.0
        self.live: Any = None

    def __enter__(self) -> "Progress":
        if self.tty:
            from rich.live import Live

            self.live = Live(self._table(), refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _table(self) -> Any:
        from rich.table import Table

        from ..units import format_duration

        t = Table(title=f"best so far: {self.best or '-'}    time left: {format_duration(self.left)}",
                  title_justify="left")
        for col in ("#", "config", "outcome", "tokens/s", "peak", "predicted", "worker"):
            t.add_column(col)
        for row in self.rows[-25:]:
            t.add_row(*row)
        return t

    def __call__(self, e: Any) -> None:
        from ..report import config_brief
        from ..units import format_duration, format_size

        r = e.result
        outcome = (r.outcome.value + (" (again)" if e.kind == "again" else "")) if r else f"skip: {e.kind}"
        tps = f"{r.tokens_per_s:,.0f}" if r and r.tokens_per_s else "-"
        peak = format_size(r.peak_memory_bytes) if r else "-"
        row = (str(e.number), config_brief(e.config), outcome, tps, peak, format_size(e.predicted), e.worker)
        if e.best is not None:
            self.best = f"{e.best.tokens_per_s:,.0f} tokens/s ({config_brief(e.best.config)})"
        self.left = e.seconds_left
        if not self.enabled or (r is None and not self.tty):
            return
        self.rows.append(row)
        if self.live is not None:
            self.live.update(self._table())
        else:
            print(f"#{row[0]:>3} {row[2]:<11} {tps:>9} tok/s  peak {peak:>9} (pred {row[5]})  {row[1]}  "
                  f"[left {format_duration(e.seconds_left)}]", flush=True)


def _new_search_spec(a: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from ..envinfo import package_versions
    from ..models import resolve_model
    from ..rundir import target_dict
    from ..search import new_run_id
    from ..space import load_space
    from ..units import parse_duration

    def overrides() -> dict[str, list[int]]:
        out = {}
        for flag, key, text in (("--max-length", "max_length", a.max_length),
                                ("--global-batch", "global_batch", a.global_batch)):
            if text:
                try:
                    vals = [int(x) for x in str(text).split(",")]
                    assert all(v > 0 for v in vals)
                except (ValueError, AssertionError):
                    raise UsageError(f"{flag}: {text!r} is not a positive integer (or a comma list such "
                                     "as 4096,2048,1024).") from None
                out[key] = vals
        return out

    model, space, targets, budget, dims = gather(
        lambda: resolve_model(a.model) if a.model else _missing("--model"),
        lambda: load_space(a.space),
        lambda: resolve_targets(a.gpu, a.device, a.memory_limit, a.headroom),
        lambda: parse_duration(a.budget),
        overrides)
    if dims:
        space = space.replaced(**dims)
    run_id = new_run_id(model)
    run_dir = Path(a.out) / run_id
    if a.storage:
        storage = a.storage
    elif len(targets) > 1:
        storage = str((run_dir / "study.journal").resolve())  # SQLite locks under several writers
    else:
        storage = f"sqlite:///{(run_dir / 'study.db').resolve()}"
    spec = {
        "run_id": run_id,
        "created": run_id.split("-")[0],
        "model": model.to_dict(),
        "space": space.to_dict(),
        "targets": [target_dict(t) for t in targets],
        "budget_s": budget,
        "storage": storage,
        "study_name": a.study_name or f"autofit-{run_id}",
        "seed": a.seed,
        "probe": {"warmup_steps": a.warmup_steps, "timed_steps": a.timed_steps,
                  "max_probe_accumulation": a.max_probe_accumulation or None,
                  "timeout_s": a.probe_timeout, "confirm": a.confirm},
        "versions": package_versions(),
    }
    return spec, run_dir


def _missing(flag: str) -> Any:
    raise UsageError(f"{flag} is required (unless --resume RUN continues a search); for example "
                     f"{flag} tiny-llama.")


def _joined_spec(a: argparse.Namespace) -> dict[str, Any] | None:
    """A study that already exists at --storage under --study-name: join it with its own spec."""
    if not (a.storage and a.study_name):
        return None
    from ..search import open_study

    try:
        study = open_study(a.storage, a.study_name, create=False, seed=a.seed)
    except KeyError:
        return None
    except Exception as e:  # a storage that cannot be reached
        raise UsageError(f"--storage: cannot open {a.storage} ({type(e).__name__}: {e}).") from None
    return study.user_attrs.get("spec")


def cmd_search(a: argparse.Namespace) -> int:
    from ..envinfo import collect, gpus
    from ..rundir import model_of, read_spec, space_of, target_dict, targets_of, write_spec
    from ..search import Search, SearchSettings, open_study, skipped_counts, study_rows
    from ..units import format_duration, parse_duration

    if a.resume:
        run_dir = Path(a.resume)
        spec = read_spec(run_dir, "--resume")
        if a.gpu is not None or a.device is not None:
            spec["targets"] = [target_dict(t) for t in resolve_targets(
                a.gpu, a.device, a.memory_limit or None, a.headroom)]
        if a.budget_given:
            spec["budget_s"] = parse_duration(a.budget)
    elif (joined := _joined_spec(a)) is not None:
        spec = dict(joined)
        spec["targets"] = [target_dict(t) for t in resolve_targets(a.gpu, a.device, a.memory_limit, a.headroom)]
        spec["run_id"] = spec["run_id"] + "-worker-" + Path.cwd().name
        run_dir = Path(a.out) / spec["run_id"]
    else:
        spec, run_dir = _new_search_spec(a)
    space, model, targets = space_of(spec), model_of(spec), targets_of(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_spec(run_dir, spec)
    env = collect()
    (run_dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    for g in gpus():
        if any(t.gpu_index == g.index for t in targets) and g.other_processes:
            print(f"autofit: warning: GPU {g.index} already has {g.other_processes} other process(es); "
                  "their memory and load distort the measurements.", file=sys.stderr)
    study = open_study(spec["storage"], spec["study_name"], create=True, seed=spec["seed"])
    if "spec" not in study.user_attrs:
        study.set_user_attr("spec", spec)
    probe = spec["probe"]
    settings = SearchSettings(
        space=space, model=model, targets=targets, run_dir=run_dir, storage=spec["storage"],
        study_name=spec["study_name"], budget_s=spec["budget_s"], seed=spec["seed"],
        probe_timeout_s=probe["timeout_s"], warmup_steps=probe["warmup_steps"],
        timed_steps=probe["timed_steps"], max_probe_accumulation=probe["max_probe_accumulation"],
        standby=a.standby if a.standby is not None else (2 if targets[0].device == "cuda" else 1),
        local_storage=not a.storage, confirm=probe.get("confirm", 1))
    if not a.json:
        print(f"autofit: searching {model.ref} on {', '.join(t.describe() for t in targets)}; "
              f"space {space.name} ({len(space.candidates())} configs); budget {format_duration(spec['budget_s'])}; "
              f"run folder {run_dir}", file=sys.stderr)
    interrupted = False
    reason = ""
    with Progress(not a.json) as progress:
        try:
            reason = Search(settings, progress).run()
        except KeyboardInterrupt:
            interrupted, reason = True, "interrupted (Ctrl-C); continue with --resume"
    from ..report import nothing_fits_message, write_outputs

    rows, timeline = study_rows(study)
    best = write_outputs(run_dir, spec, rows, timeline, reason)
    skipped = skipped_counts(study)
    if a.json:
        print(json.dumps({"run_dir": str(run_dir), "stop_reason": reason, "probes": len(rows),
                          "skipped": skipped, "best": best}, indent=1))
    if interrupted:
        print(f"autofit: interrupted; the study is saved. Continue with: autofit search --resume {run_dir}",
              file=sys.stderr)
        return 130
    if best is None:
        from ..result import ProbeResult

        raise NothingFits(nothing_fits_message([ProbeResult.from_dict(r) for r in rows],
                                               targets[0].memory_limit_bytes)
                          + f" Report: {run_dir / 'report.md'}")
    if not a.json:
        from ..report import config_brief
        from ..units import format_size

        print(f"\nbest: {best['tokens_per_s']:,.0f} tokens/s, peak {format_size(best['peak_memory_bytes'])} "
              f"({config_brief(best['config'])})\nstopped: {reason}; {len(rows)} probes, skipped "
              f"{sum(skipped.values())} ({', '.join(f'{k} {v}' for k, v in sorted(skipped.items())) or 'none'})\n"
              f"report: {run_dir / 'report.md'}\nnext:   autofit export {run_dir} --format hf-trainer -o train.py")
    return 0


SEARCH_EPILOG = """\
examples:
  autofit search --model tiny-llama --space cpu-demo --budget 3m     # anywhere, on the CPU without a GPU
  autofit search --model llama2-7b --gpu 0 --memory-limit 40GiB --budget 30m
  autofit search --model llama2-7b --memory-limit 24GiB --space qlora --max-length 4096,2048,1024
  autofit search --model ./my-model --gpu 0,1 --budget 1h           # one worker per GPU, one study
  autofit search --resume runs/20261202T101500Z-llama2-7b            # after Ctrl-C or a crash
  # several hosts, one study (each host runs the same command):
  autofit search --model llama2-7b --storage postgresql+psycopg://user:pw@db/autofit --study-name s1

exit codes: 0 a fit was found, 2 usage error, 3 nothing fits, 130 interrupted (resume it)
"""


def add_parser(sub: Any, fmt: Any) -> None:
    se = sub.add_parser("search", help="find the fastest configuration that fits", formatter_class=fmt,
                        epilog=SEARCH_EPILOG)
    se.add_argument("--model", help="preset, local folder, config.json, or hub id")
    se.add_argument("--space", default="lora", help="search space: lora, qlora, full, cpu-demo, or a YAML path")
    add_target_flags(se)
    se.add_argument("--budget", default=None, help="wall-clock budget for the whole search (default 30m)")
    se.add_argument("--max-length", help="replace the space's lengths (comma list: longest that fits wins)")
    se.add_argument("--global-batch", help="replace the space's sequences per optimizer step")
    se.add_argument("--out", default="runs", help="where run folders go (default runs/)")
    se.add_argument("--storage", help="Optuna storage URL shared by workers (postgresql+psycopg://..., sqlite:///...) "
                                      "or a .journal file path")
    se.add_argument("--study-name", help="study to create or join at --storage")
    se.add_argument("--resume", metavar="RUN_FOLDER", help="continue a search; finished probes are not re-run")
    se.add_argument("--json", action="store_true", help="print a JSON summary (no live table)")
    se.add_argument("--seed", type=int, default=0, help="sampler seed")
    se.add_argument("--standby", type=int, default=None,
                    help="probe processes importing ahead of need, per worker (default: 2 on a GPU, "
                         "1 on the CPU); importing torch+transformers+peft takes 15-20 s on a GPU host")
    se.add_argument("--probe-timeout", type=float, default=900.0, help="seconds before one probe is stopped")
    se.add_argument("--warmup-steps", type=int, default=2, help="optimizer steps before timing (>= 2)")
    se.add_argument("--timed-steps", type=int, default=5, help="timed optimizer steps (>= 5)")
    se.add_argument("--max-probe-accumulation", type=int, default=4,
                    help="micro-steps per probed optimizer step; more are extrapolated (0: all)")
    se.add_argument("--confirm", type=int, default=1,
                    help="fits within 5%% of the best to measure again, in a fresh process, before one is "
                         "called the winner (its tokens/s: the median of the runs); time for one is kept "
                         "in the budget; a best that a repeat leaves unmeasured-again is measured too "
                         "(default 1; 0: none)")
    se.set_defaults(func=cmd_search)
