"""`autofit env`: what a bug report needs."""

from __future__ import annotations

import argparse
import json

from autofit.cli.common import Formatter, Subcommands
from autofit.core.envinfo import collect


def cmd_env(args: argparse.Namespace) -> int:
    env = collect()
    if args.json:
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


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    en = sub.add_parser("env", help="GPUs, driver, CUDA and package versions", formatter_class=fmt,
                        epilog="examples:\n  autofit env\n  autofit env --json > env.json\n\nexit codes: 0\n")
    en.add_argument("--json", action="store_true")
    en.set_defaults(func=cmd_env)
