"""What every subcommand shares: messages, exit codes, and the flag groups declared once."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TypeAlias

from rich.console import Console

from autofit.config.target import HEADROOM
from autofit.core.errors import UsageError, gather
from autofit.data import DatasetRef, TextMode, load_samples
from autofit.data.preference import looks_like_preferences, read_preferences
from autofit.protocol.request import MAX_PROBE_ACCUMULATION, TIMED_STEPS, WARMUP_STEPS
from autofit.run.rundir import PROBE_TIMEOUT_S, ProbeSettings

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What each subcommand's `add_parser(sub, fmt)` adds its parser to (argparse's own class)."""
Formatter: TypeAlias = type[argparse.HelpFormatter]
"""The help formatter every subcommand's parser shares (cli.main's)."""

__all__ = [
    "EXIT_CODES",
    "add_data_flags",
    "data_fields",
    "add_probe_flags",
    "add_target_flags",
    "check_shared_flags",
    "dataset_ref",
    "err",
    "fraction",
    "gather",
    "probe_settings",
]

EXIT_CODES = """\
exit codes: 0 done (a fit was found), 1 a regression found (regress) or an unexpected error,
  2 usage error (a flag, a value or a file; nothing was run), 3 no fit found: nothing fits, or no probe
  finished in the budget (the message says which; --resume continues it),
  4 cannot write (a read-only or full disk, an unwritable storage; what was measured is kept),
  130 interrupted (Ctrl-C, SIGTERM, SIGHUP or SIGQUIT; a search continues with --resume)
"""


def console() -> Console:
    return Console(stderr=False, highlight=False, soft_wrap=True)


def err(msg: str) -> None:
    print(f"autofit: error: {msg}", file=sys.stderr)


def warn(msg: str) -> None:
    print(f"autofit: warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- flag groups


def add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where")
    g.add_argument("--gpu", help="GPU index, or a comma list for one worker per GPU (default: 0 if any); "
                                 "with --gpus N, the list is cut into groups of N, one worker per group")
    g.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="GPUs one probe spans (default 1): its ranks are launched with torchrun and share "
                        "the global batch; --gpu 0,1 alone runs two single-GPU workers side by side instead. "
                        "On --device cpu: N processes with the gloo backend")
    g.add_argument("--device", choices=None, help="cpu to run on the CPU even where a GPU exists")
    g.add_argument("--memory-limit", metavar="SIZE",
                   help="emulate a smaller card: 24GiB (RTX 3090/4090), 40GiB (A100-40G), 80GiB; "
                        "a unit is required (GiB = 2**30 bytes, GB = 1e9)")
    g.add_argument("--headroom", type=share, default=HEADROOM,
                   help=f"share of the limit kept free, as 5%% or 0.05; a peak inside it does not fit "
                        f"(default {HEADROOM * 100:g}%%)")


def add_probe_flags(p: argparse.ArgumentParser, timeout_flag: str = "--timeout") -> None:
    """How each probe measures: shared by `probe` and `search`."""
    p.set_defaults(timeout_flag=timeout_flag)
    g = p.add_argument_group("measuring")
    g.add_argument(timeout_flag, dest="probe_timeout", type=float, metavar="SECONDS", default=PROBE_TIMEOUT_S,
                   help=f"seconds before one probe is stopped (default {PROBE_TIMEOUT_S:.0f})")
    g.add_argument("--warmup-steps", type=int, metavar="N", default=WARMUP_STEPS,
                   help=f"optimizer steps before timing (>= {WARMUP_STEPS})")
    g.add_argument("--timed-steps", type=int, metavar="N", default=TIMED_STEPS,
                   help=f"timed optimizer steps (>= {TIMED_STEPS})")
    g.add_argument("--max-probe-accumulation", type=int, metavar="N", default=MAX_PROBE_ACCUMULATION,
                   help="micro-steps per probed optimizer step; more are extrapolated "
                        f"(default {MAX_PROBE_ACCUMULATION}; 0: all)")


def add_data_flags(p: argparse.ArgumentParser, with_dataset: bool = True, resumes: bool = False) -> None:
    """The dataset flags: shared by `data`, `probe` and `search`."""
    g = p.add_argument_group("data")
    if with_dataset:
        g.add_argument("--dataset", metavar="PATH",
                       help="train on this data: JSONL (text or messages), CSV, text file, save_to_disk "
                            "folder or parquet; lengths and a `batching` dimension come from it (default: "
                            "random tokens)"
                            + ("; with --resume, where the run's dataset is now if it moved" if resumes
                               else ""))
    g.add_argument("--text-field", metavar="NAME",
                   help="the text field of JSONL/CSV/parquet rows (default text); given without "
                        "--messages-field, only text is read, not chats")
    g.add_argument("--messages-field", metavar="NAME",
                   help="the chat field: a list of {role, content} (default messages); a row with both "
                        "fields is read as its chat")
    g.add_argument("--text-mode", default="auto", choices=("auto", "lines", "paragraphs", "whole"),
                   help="plain text files: one sample per line, per blank-line block, or the whole file")


def data_fields(args: argparse.Namespace) -> tuple[str, str]:
    """(text field, messages field) as given: --text-field alone names the only field read ('' for the
    messages field: a row holding a default 'messages' chat too is read as its text, as asked)."""
    text = args.text_field if args.text_field is not None else "text"
    if args.messages_field is not None:
        return text, args.messages_field
    return text, "" if args.text_field is not None else "messages"


def dataset_ref(args: argparse.Namespace) -> DatasetRef | None:
    """--dataset read (bad input: a UsageError naming the flag and file) as the reference a run keeps;
    bad rows are reported on stderr with their first line numbers. Rows with chosen/rejected are preference
    pairs (every bad row an error)."""
    if not getattr(args, "dataset", None):
        return None
    if looks_like_preferences(args.dataset):  # TRL's preference formats: pairs for a DPO probe
        return DatasetRef.of_preferences(read_preferences(args.dataset))
    text_field, messages_field = data_fields(args)
    data = load_samples(args.dataset, text_field, messages_field, TextMode(args.text_mode))
    if data.bad.count:
        warn(f"--dataset {args.dataset}: {data.bad.summary()}")
    return DatasetRef.of(data, text_field, messages_field)


def probe_settings(args: argparse.Namespace) -> ProbeSettings:
    return ProbeSettings(warmup_steps=args.warmup_steps, timed_steps=args.timed_steps,
                         max_probe_accumulation=args.max_probe_accumulation or None,
                         timeout_s=args.probe_timeout,
                         confirm=getattr(args, "confirm", ProbeSettings.confirm),
                         train_tokens=getattr(args, "train_tokens", None) or ProbeSettings.train_tokens,
                         train_steps=getattr(args, "train_steps", None))


MAX_STANDBY = 8
"""Most probe processes importing ahead of need, per worker (the default is 2 on a GPU, 1 on the CPU)."""
PATH_FLAGS = {"model": ("--model", "a preset, a model folder, a config.json or a hub id"),
              "space": ("--space", "a shipped space or a YAML file"),
              "dataset": ("--dataset", "a dataset file or folder"),
              "out": ("--out", "a folder"), "resume": ("--resume", "a run folder made by `autofit search`"),
              "storage": ("--storage", "a database URL or a .journal file"),
              "log_dir": ("--log-dir", "a folder"), "run": ("RUN", "a run folder made by `autofit search`"),
              "path": ("PATH", "a dataset file or folder"),
              "study_name": ("--study-name", "a name for the study"),
              "output": ("-o/--output", "a file path (or - for standard output)"),
              "json": ("--json", "a file path"), "junit": ("--junit", "a file path"),
              "gpu": ("--gpu", "a GPU index or a comma list such as 0,1")}
"""Flags that take a path or a name: an empty value (`--out "$DIR"` with DIR unset) is refused, never
read as the flag's default or the current folder."""


def check_shared_flags(args: argparse.Namespace) -> None:
    """The ranges of the shared flags, all problems at once (flags a command lacks are skipped)."""
    problems = [f"{flag}: an empty value; give {what}." for dest, (flag, what) in PATH_FLAGS.items()
                if isinstance(getattr(args, dest, None), str) and not getattr(args, dest).strip()]
    reads_data = hasattr(args, "dataset") and hasattr(args, "text_mode")  # search, probe, plan
    if reads_data and not args.dataset and not getattr(args, "resume", None):
        given = [flag for flag, on in (("--text-field", args.text_field is not None),
                                       ("--messages-field", args.messages_field is not None),
                                       ("--text-mode", args.text_mode != "auto")) if on]
        if given:  # they read --dataset's rows: without one they were dropped, the probes on random tokens
            problems.append(f"{' and '.join(given)}: read the rows of --dataset, which is not given; add "
                            "--dataset PATH (without it the probes train on random tokens).")
    if getattr(args, "warmup_steps", WARMUP_STEPS) < WARMUP_STEPS:
        problems.append(f"--warmup-steps: at least {WARMUP_STEPS} (optimizer state is allocated on the first "
                        "step).")
    if getattr(args, "timed_steps", TIMED_STEPS) < TIMED_STEPS:
        problems.append(f"--timed-steps: at least {TIMED_STEPS} timed steps give a median worth reporting.")
    tokens, steps = getattr(args, "train_tokens", None), getattr(args, "train_steps", None)
    if tokens is not None and tokens < 1:
        problems.append("--train-tokens: a positive number of tokens (the planned training length).")
    if steps is not None and steps < 1:
        problems.append("--train-steps: a positive number of optimizer steps (the planned training length).")
    if steps is not None and tokens is not None:
        problems.append("--train-tokens and --train-steps both give the planned training length; give one.")
    if getattr(args, "max_probe_accumulation", 0) < 0:
        problems.append("--max-probe-accumulation: give 0 (all micro-steps) or a positive number.")
    # --timeout on probe, --probe-timeout on search, regress
    if not 0 < getattr(args, "probe_timeout", 1) < math.inf:
        flag = getattr(args, "timeout_flag", "--probe-timeout")
        problems.append(f"{flag}: give a positive, finite number of seconds.")
    standby = getattr(args, "standby", None)
    if standby is not None and not 0 <= standby <= MAX_STANDBY:
        problems.append(f"--standby: {standby} is not from 0 to {MAX_STANDBY}; give how many probe processes "
                        "import ahead of need (each holds torch, transformers and peft in host memory; 0 for "
                        "none).")
    seed = getattr(args, "seed", 0)
    if not 0 <= seed < 2**32:  # numpy's and Optuna's samplers take a 32-bit seed
        problems.append(f"--seed: {seed} is not from 0 to {2**32 - 1}; give a sampler seed in that range.")
    if getattr(args, "confirm", 0) < 0:
        problems.append(f"--confirm: {args.confirm} is negative; give how many of the best fits to measure "
                        "again (0 for none, default 1).")
    if problems:
        raise UsageError(problems)


class CommaList(argparse.Action):
    """A list flag taking its values spaced or as one comma list (`1024 2048` or `1024,2048`, as `autofit data`
    does): stored as the comma list the space reads."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs="+", **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parts = values if isinstance(values, list) else [values]
        setattr(namespace, self.dest, ",".join(str(v).strip(",") for v in parts))


def _percent(text: str) -> float | None:
    """`5%` or `0.05` -> 0.05; None where it is neither."""
    t = str(text).strip()
    try:
        return float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        return None


def share(text: str) -> float:
    """An argparse type: `5%` or `0.05` -> 0.05 (the range is the flag's own check)."""
    value = _percent(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share; give for example 5% or 0.05")
    return value


def fraction(text: str, flag: str) -> float:
    value = _percent(text)
    if value is not None and value >= 1:
        meant = f"; did you mean {text.strip()}%?" if "%" not in text and value < 100 else "."
        raise UsageError(f"{flag}: {text!r} is 100% or more of the baseline{meant} A tolerance is below 100%, "
                         "such as 7% (or 0.07).")
    if value is None or not 0 <= value < 1:
        raise UsageError(f"{flag}: {text!r} is not a tolerance; expected a percentage such as 7% (or 0.07).")
    return value


def attach_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--budget -5m` -> `--budget=-5m`: a value that starts with '-' reaches the flag's own check
    (argparse would take it for an option and say "expected one argument")."""
    takes_value = {s for a in _all_actions(parser) if a.nargs in (None, "+") and a.option_strings
                   for s in a.option_strings}
    known = {s for a in _all_actions(parser) for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1] not in known and argv[i + 1].split("=")[0] not in known:
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)  # argparse offers no public walk over subparsers
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                actions += _all_actions(sub)
    return actions


_err = err  # the names other subcommand modules imported before
_console = console
