"""`autofit export`: the winner as a training recipe."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from autofit.cli.common import Formatter, Subcommands
from autofit.core.errors import UsageError
from autofit.core.paths import shown
from autofit.export import SCRIPTS, export_run, stdout_notes, write_rendered
from autofit.run import locks
from autofit.run.rundir import SEARCH_LOCK


def cmd_export(args: argparse.Namespace) -> int:
    searching = locks.holder(Path(args.run) / SEARCH_LOCK)
    if searching and not (Path(args.run) / "best.json").is_file():
        raise UsageError(f"RUN: a search is running in {shown(args.run)} ({searching}); it writes best.json "
                         f"when it ends. `autofit report {shown(args.run)}` shows its best so far.")
    rendered = export_run(args.run, args.format, args.dataset)
    if searching:
        print(f"autofit: warning: a search is running in {shown(args.run)} ({searching}); this exports the "
              "best found so far (best.json as `autofit report` last wrote it), which the search may still "
              "beat",
              file=sys.stderr)
    elif not search_finished(Path(args.run)):
        print(f"autofit: warning: the search in {shown(args.run)} did not finish (report.md says why); this "
              f"exports its best so far, which a longer search may beat: `autofit search --resume "
              f"{shown(args.run)}` continues it", file=sys.stderr)
    for note in rendered.notes:
        print(f"autofit: warning: {note}", file=sys.stderr)
    for item in rendered.unexpressed:
        print(f"autofit: warning: {rendered.format} cannot express {item}", file=sys.stderr)
    if not args.output or args.output == "-":  # a stdout that cannot take it is exit 4 (cli/streams.py)
        sys.stdout.write(rendered.text)
        for line in stdout_notes(rendered):
            print(f"autofit: {line}", file=sys.stderr)
        return 0
    # the recipe, the files it names beside it (a DeepSpeed JSON, an accelerate config) and how to launch it
    for line in write_rendered(rendered, Path(args.output), args.force, executable=rendered.format in SCRIPTS,
                               run_dir=Path(args.run)):
        print(line, file=sys.stderr)
    return 0


def search_finished(run: Path) -> bool:
    """best.json's word on the search that wrote it (True where it has none: a run written before it said)."""
    try:
        return json.loads((run / "best.json").read_text()).get("search_finished", True) is not False
    except (OSError, ValueError, AttributeError):
        return True  # export_run has read it already: a file gone since says nothing of the search


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    ex = sub.add_parser("export", help="write the winner as a training recipe", formatter_class=fmt,
                        epilog=textwrap.dedent("""\
                            formats:
                              hf-trainer     standalone transformers Trainer + peft script (default)
                              trl            the same through TRL SFTTrainer / SFTConfig (a DPO winner:
                                             DPOTrainer / DPOConfig, its default)
                              axolotl        axolotl YAML
                              llama-factory  LLaMA-Factory YAML

                            examples:
                              autofit export runs/<id> -o train.py && python train.py --dataset data.jsonl
                              autofit export runs/<id> --format trl -o train_trl.py
                              autofit export runs/<id> --format axolotl -o axolotl.yaml
                              autofit export runs/<id> --dataset /data/moved/train.jsonl -o train.py

                            a winner on several GPUs (gpus > 1, engine fsdp2 | zero2 | zero3): the recipe
                            carries the engine's settings, its DeepSpeed JSON or accelerate config is written
                            beside -o (an existing one with other content needs --force), and the launch
                            command (torchrun, axolotl --launcher torchrun, accelerate launch) is printed

                            exit codes: 0 written, 2 usage error (not a run folder, a corrupt best.json or
                            one whose winner is not a fit, an existing -o without --force, an -o in a folder
                            that does not exist, a run's dataset that changed since the search, a --dataset
                            that is missing or not the measured content), 4 cannot write (a full disk, a
                            read-only folder: nothing is written, not even an empty file)
                            """))
    ex.add_argument("run", help="a run folder made by autofit search")
    ex.add_argument("--format", help="hf-trainer | trl | axolotl | llama-factory (default: hf-trainer; trl for a "
                                     "DPO winner)")
    ex.add_argument("-o", "--output", help="output file (default, or -: stdout); an existing one needs "
                                           "--force")
    ex.add_argument("--force", action="store_true", help="overwrite the -o file if it exists")
    ex.add_argument("--dataset", metavar="PATH",
                    help="where the run's dataset is now, if it moved since the search (its content must be "
                         "the one measured: a changed file exits 2); the recipe names this path")
    ex.set_defaults(func=cmd_export)
