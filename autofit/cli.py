"""The command line: the only place that prints or picks exit codes."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

from .errors import AutofitError, NothingFits, UsageError
from .models import PRESET_HELP, PRESETS
from .spec import KEYS
from .target import resolve_targets


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=False, highlight=False, soft_wrap=True)


def _err(msg: str) -> None:
    print(f"autofit: error: {msg}", file=sys.stderr)


def gather(*steps: Callable[[], Any]) -> list[Any]:
    """Run each step; collect every UsageError and raise them once, together."""
    out, problems = [], []
    for step in steps:
        try:
            out.append(step())
        except UsageError as e:
            problems += e.problems
            out.append(None)
    if problems:
        raise UsageError(problems)
    return out


# --------------------------------------------------------------------------- targets


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--gpu", help="GPU index, or a comma list for one worker per GPU (default: 0 if any)")
    g.add_argument("--device", choices=None, help="cpu to run on the CPU even where a GPU exists")
    g.add_argument("--memory-limit", metavar="SIZE",
                   help="emulate a smaller card: 24GiB (RTX 3090/4090), 40GiB (A100-40G), 80GiB")
    g.add_argument("--headroom", type=float, default=0.05,
                   help="fraction of the limit kept free; a peak inside it does not fit (default 0.05)")


# --------------------------------------------------------------------------- probe


def cmd_probe(a: argparse.Namespace) -> int:
    from .models import resolve_model
    from .runner import Runner
    from .spec import TrialConfig, parse_sets

    cfg, model, targets = gather(lambda: TrialConfig.from_mapping(parse_sets(a.set or [])),
                                 lambda: resolve_model(a.model),
                                 lambda: resolve_targets(a.gpu, a.device, a.memory_limit, a.headroom))
    target = targets[0]
    log_dir = Path(a.log_dir) if a.log_dir else Path("runs") / "probes"
    if not a.json:
        print(f"probing {model.ref} on {target.describe()} ...", file=sys.stderr)
    with Runner(target, log_dir, standby=0, warmup_steps=a.warmup_steps, timed_steps=a.timed_steps,
                max_probe_accumulation=a.max_probe_accumulation or None) as runner:
        from datetime import datetime, timezone

        name = "probe-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        res = runner.run(cfg, model, name=name, timeout=a.timeout)
    if a.json:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        from .report import probe_summary

        _console().print(probe_summary(res))
    return 0


# --------------------------------------------------------------------------- env


def cmd_env(a: argparse.Namespace) -> int:
    from .envinfo import collect

    env = collect()
    if a.json:
        print(json.dumps(env, indent=1))
        return 0
    lines = [f"python        {env['python']} ({env['platform']})"]
    for pkg, v in env["packages"].items():
        lines.append(f"{pkg:<13} {v}")
    lines.append(f"torch CUDA    {env['torch_cuda_build'] or 'cpu build'}")
    lines.append(f"driver        {env['driver'] or 'none (no NVIDIA driver)'}")
    lines.append(f"CUDA (driver) {env['cuda_driver'] or '-'}")
    if not env["gpus"]:
        lines.append("GPUs          none: probes run on the CPU (memory = host RSS added by the probe)")
    for g in env["gpus"]:
        others = f", {g['other_processes']} other process(es) on it" if g["other_processes"] else ""
        lines.append(f"GPU {g['index']:<9} {g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, "
                     f"{g['used_bytes'] / 2**30:.1f} GiB in use{others}")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- parser

PROBE_EPILOG = """\
keys for --set (default in brackets):
{keys}

presets for --model (random weights: same memory and speed as trained ones):
{presets}

examples:
  autofit probe --model tiny-llama --device cpu --set max_length=256
  autofit probe --model llama2-7b --gpu 0 --memory-limit 40GiB --set micro_batch_size=2
  autofit probe --model llama2-7b --memory-limit 24GiB --set gradient_checkpointing=on \\
      --set quantization=nf4 --json
  autofit probe --model ./my-model --set gradient_checkpointing=every_2+offload
"""


def _keys_help() -> str:
    rows = []
    for k in KEYS.values():
        mark = " *" if k.changes_learning else ""
        rows.append(f"  {k.name:<22} [{k.default}] {k.help}{mark}")
    return "\n".join(rows) + "\n  (* changes what is learned)"


def _presets_help() -> str:
    return "\n".join(f"  {name:<12} {PRESET_HELP[name]}" for name in PRESETS)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="autofit", formatter_class=fmt,
        description="Find, by measurement, the fastest fine-tuning configuration that fits on a GPU.",
        epilog=textwrap.dedent("""\
            examples:
              autofit search --model tiny-llama --space cpu-demo --budget 3m   # runs anywhere (CPU without a GPU)
              autofit search --gpu 0 --budget 30m --model llama2-7b --memory-limit 40GiB
              autofit export runs/<id> --format hf-trainer -o train.py
              autofit regress runs/<id> --junit regress.xml
              autofit env
            """),
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pr = sub.add_parser("probe", help="measure one configuration in a child process", formatter_class=fmt,
                        epilog=PROBE_EPILOG.format(keys=_keys_help(), presets=_presets_help()))
    pr.add_argument("--model", required=True, help="preset, local folder, config.json, or hub id")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="a configuration key (repeatable)")
    _add_target_flags(pr)
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.add_argument("--timeout", type=float, default=900.0, help="seconds before the probe is stopped")
    pr.add_argument("--warmup-steps", type=int, default=2, help="optimizer steps before timing (>= 2)")
    pr.add_argument("--timed-steps", type=int, default=5, help="timed optimizer steps (>= 5)")
    pr.add_argument("--max-probe-accumulation", type=int, default=4,
                    help="micro-steps per probed optimizer step; more are extrapolated (0: all)")
    pr.add_argument("--log-dir", help="where the probe's log goes (default runs/probes)")
    pr.set_defaults(func=cmd_probe)

    en = sub.add_parser("env", help="GPUs, driver, CUDA and package versions", formatter_class=fmt,
                        epilog="examples:\n  autofit env\n  autofit env --json > env.json\n")
    en.add_argument("--json", action="store_true")
    en.set_defaults(func=cmd_env)

    _add_run_commands(sub, fmt)
    return p


# --------------------------------------------------------------------------- search


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

        from .units import format_duration

        t = Table(title=f"best so far: {self.best or '-'}    time left: {format_duration(self.left)}",
                  title_justify="left")
        for col in ("#", "config", "outcome", "tokens/s", "peak", "predicted", "worker"):
            t.add_column(col)
        for row in self.rows[-25:]:
            t.add_row(*row)
        return t

    def __call__(self, e: Any) -> None:
        from .report import config_brief
        from .units import format_duration, format_size

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
    from .envinfo import package_versions
    from .models import resolve_model
    from .rundir import target_dict
    from .search import new_run_id
    from .space import load_space
    from .units import parse_duration

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
    from .search import open_study

    try:
        study = open_study(a.storage, a.study_name, create=False, seed=a.seed)
    except KeyError:
        return None
    except Exception as e:  # a storage that cannot be reached
        raise UsageError(f"--storage: cannot open {a.storage} ({type(e).__name__}: {e}).") from None
    return study.user_attrs.get("spec")


def cmd_search(a: argparse.Namespace) -> int:
    from .envinfo import collect, gpus
    from .rundir import model_of, read_spec, space_of, target_dict, targets_of, write_spec
    from .search import Search, SearchSettings, open_study, skipped_counts, study_rows
    from .units import format_duration, parse_duration

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
    from .report import nothing_fits_message, write_outputs

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
        from .result import ProbeResult

        raise NothingFits(nothing_fits_message([ProbeResult.from_dict(r) for r in rows],
                                               targets[0].memory_limit_bytes)
                          + f" Report: {run_dir / 'report.md'}")
    if not a.json:
        from .report import config_brief
        from .units import format_size

        print(f"\nbest: {best['tokens_per_s']:,.0f} tokens/s, peak {format_size(best['peak_memory_bytes'])} "
              f"({config_brief(best['config'])})\nstopped: {reason}; {len(rows)} probes, skipped "
              f"{sum(skipped.values())} ({', '.join(f'{k} {v}' for k, v in sorted(skipped.items())) or 'none'})\n"
              f"report: {run_dir / 'report.md'}\nnext:   autofit export {run_dir} --format hf-trainer -o train.py")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from .report import write_outputs
    from .rundir import read_spec
    from .search import open_study, study_rows

    run_dir = Path(a.run)
    spec = read_spec(run_dir)
    try:
        study = open_study(spec["storage"], spec["study_name"], create=False, seed=spec.get("seed", 0))
    except KeyError:
        raise UsageError(f"RUN: the study {spec['study_name']!r} is not in {spec['storage']}; "
                         "the run folder's study file may have been removed.") from None
    rows, timeline = study_rows(study)
    best = write_outputs(run_dir, spec, rows, timeline)
    print(f"rebuilt {run_dir / 'trials.jsonl'} ({len(rows)} probes), "
          f"{'best.json, ' if best else ''}report.md and plots")
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from .export import export_run

    rendered = export_run(a.run, a.format)
    for item in rendered.unexpressed:
        print(f"autofit: warning: {a.format} cannot express {item}", file=sys.stderr)
    if not a.output:
        sys.stdout.write(rendered.text)
        return 0
    out = Path(a.output)
    try:
        out.write_text(rendered.text)
    except OSError as e:
        raise UsageError(f"-o: cannot write {out} ({e.strerror}); give a writable path.") from None
    if a.format in ("hf-trainer", "trl"):
        out.chmod(0o755)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _fraction(text: str, flag: str) -> float:
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise UsageError(f"{flag}: {text!r} is not a tolerance; expected a percentage such as 7% (or 0.07).")
    return value


def cmd_regress(a: argparse.Namespace) -> int:
    from . import regress
    from .errors import RegressionFound
    from .rundir import model_of, read_spec, targets_of
    from .target import Target

    run_dir = Path(a.run)
    spec = read_spec(run_dir)
    best_path = run_dir / "best.json"
    if not best_path.is_file():
        raise UsageError(f"RUN: {run_dir} has no best.json (no fitting probe): there is no baseline to check.")
    best = json.loads(best_path.read_text())
    tol, mem_tol = gather(lambda: _fraction(a.tolerance, "--tolerance"),
                          lambda: _fraction(a.memory_tolerance, "--memory-tolerance"))
    if a.top < 1:
        raise UsageError("--top: at least 1 (the winner).")
    stored = targets_of(spec)[0]
    if a.gpu is not None or a.device is not None:
        target = resolve_targets(a.gpu, a.device, a.memory_limit, stored.headroom)[0]
        if not a.memory_limit:
            target = Target(target.device, target.gpu_index, target.gpu_name, stored.memory_limit_bytes,
                            stored.headroom)
    else:
        target = stored
        if target.device == "cuda":  # the same index, but read what is there now
            target = resolve_targets(str(stored.gpu_index), None, a.memory_limit, stored.headroom)[0]
            if not a.memory_limit:
                target = Target("cuda", target.gpu_index, target.gpu_name, stored.memory_limit_bytes, stored.headroom)
        elif a.memory_limit:
            target = resolve_targets(None, "cpu", a.memory_limit, stored.headroom)[0]
    regress.check_gpu(best.get("target", {}), target, a.allow_gpu_change)
    env_now = regress.now_env()
    env_before = json.loads((run_dir / "env.json").read_text()) if (run_dir / "env.json").is_file() else {}
    print(f"autofit regress: {run_dir} on {target.describe()}", file=sys.stderr)
    print("what changed since the baseline:")
    for what, before, now, changed in regress.version_diff(env_before, env_now):
        print(f"  {'*' if changed else ' '} {what:<17} {before:<28} {now}")
    configs = regress.baseline_configs(best, a.top)

    def show(c: Any) -> None:
        mark = {"ok": "ok", "faster": "FASTER", "slower": "SLOWER", "heavier": "HEAVIER",
                "no_longer_fits": "NO LONGER FITS"}[c.status]
        print(f"[{mark}] " + "\n        ".join(c.messages), flush=True)

    checks = regress.run_checks(configs, model_of(spec), target, run_dir / "logs", spec.get("probe", {}), tol,
                                mem_tol, show)
    regress.append_history(run_dir, checks, env_now, target.memory_limit_bytes)
    trend = regress.plot_trend(run_dir, regress.read_history(run_dir))
    failed = [c for c in checks if c.failed]
    doc = {"run": str(run_dir), "target": target.describe(), "tolerance": tol, "memory_tolerance": mem_tol,
           "regression": bool(failed), "checks": [c.__dict__ for c in checks],
           "versions": [{"what": w, "baseline": b, "now": n, "changed": ch}
                        for w, b, n, ch in regress.version_diff(env_before, env_now)]}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.junit:
        Path(a.junit).write_text(regress.junit_xml(checks, f"autofit-regress {spec['run_id']}"))
    print(f"history: {run_dir / regress.HISTORY}; trend: {trend}")
    if a.update_baseline:
        if any(c.status == "no_longer_fits" for c in checks):
            raise RegressionFound("a baseline config no longer fits; not re-baselining. Search again.")
        kept = regress.update_baseline(run_dir, checks, env_now)
        print(f"baseline updated; the previous one is kept as {kept}")
        return 0
    if failed:
        raise RegressionFound(f"{len(failed)} of {len(checks)} config(s) regressed: "
                              + ", ".join(f"{c.name} {c.status}" for c in failed))
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


def _add_run_commands(sub: Any, fmt: Any) -> None:
    se = sub.add_parser("search", help="find the fastest configuration that fits", formatter_class=fmt,
                        epilog=SEARCH_EPILOG)
    se.add_argument("--model", help="preset, local folder, config.json, or hub id")
    se.add_argument("--space", default="lora", help="search space: lora, qlora, full, cpu-demo, or a YAML path")
    _add_target_flags(se)
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

    ex = sub.add_parser("export", help="write the winner as a training recipe", formatter_class=fmt,
                        epilog=textwrap.dedent("""\
                            formats:
                              hf-trainer     standalone transformers Trainer + peft script (default)
                              trl            the same through TRL SFTTrainer / SFTConfig
                              axolotl        axolotl YAML
                              llama-factory  LLaMA-Factory YAML

                            examples:
                              autofit export runs/<id> -o train.py && python train.py --dataset data.jsonl
                              autofit export runs/<id> --format trl -o train_trl.py
                              autofit export runs/<id> --format axolotl -o axolotl.yaml
                            """))
    ex.add_argument("run", help="a run folder made by autofit search")
    ex.add_argument("--format", default="hf-trainer", help="hf-trainer | trl | axolotl | llama-factory")
    ex.add_argument("-o", "--output", help="output file (default: stdout)")
    ex.set_defaults(func=cmd_export)

    rg = sub.add_parser("regress", help="re-measure a run's winner; exit 1 on a regression", formatter_class=fmt,
                        epilog=textwrap.dedent("""\
                            examples:
                              autofit regress runs/<id>                               # nightly, same GPU
                              autofit regress runs/<id> --top 3 --junit regress.xml --json regress.json
                              autofit regress runs/<id> --memory-limit 24GiB --tolerance 10%
                              autofit regress runs/<id> --update-baseline             # accept new figures

                            exit codes: 0 within tolerance, 1 regression (slower, heavier, or no longer
                            fits), 2 usage error (a different GPU model without --allow-gpu-change)
                            """))
    rg.add_argument("run", help="a run folder made by autofit search")
    rg.add_argument("--top", type=int, default=1, help="re-probe the winner and this many minus one runners-up")
    rg.add_argument("--tolerance", default="7%", help="slower than this is a regression (default 7%%)")
    rg.add_argument("--memory-tolerance", default="3%", help="heavier than this is a regression (default 3%%)")
    rg.add_argument("--json", metavar="PATH", help="write the checks as JSON")
    rg.add_argument("--junit", metavar="PATH", help="write JUnit XML (one test case per config)")
    _add_target_flags(rg)
    rg.add_argument("--allow-gpu-change", action="store_true", help="compare across GPU models anyway")
    rg.add_argument("--update-baseline", action="store_true",
                    help="rewrite best.json with the new figures (the old one is kept beside it)")
    rg.set_defaults(func=cmd_regress)

    rp = sub.add_parser("report", help="rebuild trials.jsonl, best.json and report.md from the study",
                        formatter_class=fmt, epilog="examples:\n  autofit report runs/<id>\n")
    rp.add_argument("run", help="a run folder")
    rp.set_defaults(func=cmd_report)


def _check_probe_args(a: argparse.Namespace) -> None:
    problems = []
    if getattr(a, "warmup_steps", 2) < 2:
        problems.append("--warmup-steps: at least 2 (optimizer state is allocated on the first step).")
    if getattr(a, "timed_steps", 5) < 5:
        problems.append("--timed-steps: at least 5 timed steps give a median worth reporting.")
    if getattr(a, "timeout", 1) <= 0:
        problems.append("--timeout: give a positive number of seconds.")
    if getattr(a, "confirm", 0) < 0:
        problems.append(f"--confirm: {a.confirm} is negative; give how many of the best fits to measure "
                        "again (0 for none, default 1).")
    if problems:
        raise UsageError(problems)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = a.func
    if a.command == "search":
        a.budget_given = a.budget is not None
        a.budget = a.budget or "30m"
    try:
        _check_probe_args(a)
        return func(a)
    except KeyboardInterrupt:
        print("\nautofit: interrupted; child processes stopped.", file=sys.stderr)
        return 130
    except AutofitError as e:
        for line in str(e).splitlines():
            _err(line)
        return e.exit_code
