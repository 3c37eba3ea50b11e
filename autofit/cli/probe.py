"""`autofit probe`: one configuration measured in a child process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..models import PRESET_HELP, PRESETS
from ..spec import KEYS
from ..target import resolve_targets
from .common import _console, add_target_flags, gather


def cmd_probe(a: argparse.Namespace) -> int:
    from ..models import resolve_model
    from ..runner import Runner
    from ..spec import TrialConfig, parse_sets

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
        from ..report import probe_summary

        _console().print(probe_summary(res))
    return 0


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


def add_parser(sub: Any, fmt: Any) -> None:
    pr = sub.add_parser("probe", help="measure one configuration in a child process", formatter_class=fmt,
                        epilog=PROBE_EPILOG.format(keys=_keys_help(), presets=_presets_help()))
    pr.add_argument("--model", required=True, help="preset, local folder, config.json, or hub id")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="a configuration key (repeatable)")
    add_target_flags(pr)
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.add_argument("--timeout", type=float, default=900.0, help="seconds before the probe is stopped")
    pr.add_argument("--warmup-steps", type=int, default=2, help="optimizer steps before timing (>= 2)")
    pr.add_argument("--timed-steps", type=int, default=5, help="timed optimizer steps (>= 5)")
    pr.add_argument("--max-probe-accumulation", type=int, default=4,
                    help="micro-steps per probed optimizer step; more are extrapolated (0: all)")
    pr.add_argument("--log-dir", help="where the probe's log goes (default runs/probes)")
    pr.set_defaults(func=cmd_probe)
