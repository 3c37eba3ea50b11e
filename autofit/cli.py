"""The command line: the only place that prints or picks exit codes."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

from .errors import AutofitError, UsageError
from .models import PRESET_HELP, PRESETS
from .spec import KEYS


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


def resolve_targets(gpu: str | None, device: str | None, memory_limit: str | None,
                    headroom: float = 0.05) -> list[Any]:
    """--gpu / --device / --memory-limit -> one Target per worker."""
    from .envinfo import gpus
    from .runner import Target
    from .units import parse_size

    limit = parse_size(memory_limit) if memory_limit else None
    if not 0 <= headroom < 0.5:
        raise UsageError(f"--headroom: {headroom} is out of range; expected a fraction such as 0.05.")
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device: {device!r} is not known; expected cpu or cuda.")
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other; give one of them.")
    found = {g.index: g for g in gpus()} if device != "cpu" else {}
    if gpu is None and (device == "cpu" or not found):
        if device == "cuda":
            raise UsageError("--device cuda: no NVIDIA GPU is visible here; use --device cpu.")
        return [Target("cpu", None, "", limit, headroom)]
    try:
        wanted = [int(x) for x in (gpu or "0").split(",") if x.strip() != ""]
    except ValueError:
        raise UsageError(f"--gpu: {gpu!r} is not a GPU index list; expected for example 0 or 0,1.") from None
    if not wanted or len(set(wanted)) != len(wanted):
        raise UsageError(f"--gpu: {gpu!r} must name each GPU once, for example 0 or 0,1.")
    problems = []
    for i in wanted:
        if i not in found:
            have = ", ".join(str(k) for k in sorted(found)) or "none"
            problems.append(f"--gpu: GPU {i} does not exist here (GPUs: {have}); "
                            "see `autofit env`, or use --device cpu.")
        elif limit and limit > found[i].memory_bytes:
            problems.append(f"--memory-limit: {memory_limit} is more than GPU {i} has "
                            f"({found[i].memory_bytes / 2**30:.1f} GiB); give a smaller limit.")
    if problems:
        raise UsageError(problems)
    return [Target("cuda", i, found[i].name, limit, headroom) for i in wanted]


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
              autofit search --model tiny-llama --budget 5m          # runs anywhere (CPU without a GPU)
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


def _add_run_commands(sub: Any, fmt: Any) -> None:
    pass


def _check_probe_args(a: argparse.Namespace) -> None:
    problems = []
    if getattr(a, "warmup_steps", 2) < 2:
        problems.append("--warmup-steps: at least 2 (optimizer state is allocated on the first step).")
    if getattr(a, "timed_steps", 5) < 5:
        problems.append("--timed-steps: at least 5 timed steps give a median worth reporting.")
    if getattr(a, "timeout", 1) <= 0:
        problems.append("--timeout: give a positive number of seconds.")
    if problems:
        raise UsageError(problems)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    func: Callable[[argparse.Namespace], int] = a.func
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
