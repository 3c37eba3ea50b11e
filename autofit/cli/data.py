"""`autofit data PATH --model M`: what a dataset's lengths say before anything is measured."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from autofit.cli.common import Formatter, Subcommands, add_data_flags, data_fields, warn
from autofit.config.models import ModelSource
from autofit.core.errors import CannotWrite, UsageError, gather
from autofit.core.paths import output_folder, shown, source
from autofit.data import TextMode, summarize
from autofit.data.preference import looks_like_preferences, summarize_preferences
from autofit.run.session import model_source

DATA_EPILOG = """\
Lengths are counted with the model's own tokenizer (a local folder or the hub cache); a shape preset
has none, so a byte-level BPE trained on the dataset to the preset's vocabulary stands in and every
output says the lengths are approximate. The length table is cached in --out by the dataset's hash
and the tokenizer.

max_length candidates: the smallest multiple of 64 covering 100%, 99.9%, 99% and 95% of the samples
(capped by the model's positions); `search --dataset` uses them unless --max-length is given.

examples:
  autofit data train.jsonl --model tiny-llama
  autofit data chats.jsonl --model ./my-model --messages-field conversation --json
  autofit data corpus.txt --model llama2-7b --text-mode paragraphs --max-length 1024 2048
  autofit data prefs.jsonl --model tiny-llama     # preference pairs (prompt/chosen/rejected, TRL's formats)

Preference pairs (rows with chosen and rejected, as text or conversations, with a prompt or without one):
the lengths of prompt, chosen, rejected and of the longer row of each pair, and at each max_length the
pairs TRL drops (the prompt fills it), those truncated and the completion tokens lost. Every bad row is
an error naming its line and field (exit 2).

exit codes: 0 summarized, 2 usage error (a missing, empty, binary file or no usable row; --out a file),
  4 --out cannot be written
"""


GIVE = "Give a JSONL, CSV, text or parquet file, or a folder saved with datasets.save_to_disk."


def default_out(path: str) -> Path:
    """./autofit-data/<name>-<8 hex of the path>: one folder per dataset, reused across calls."""
    resolved = str(Path(path).expanduser().resolve())
    return Path("autofit-data") / f"{Path(path).name}-{hashlib.sha256(os.fsencode(resolved)).hexdigest()[:8]}"


def cmd_data(args: argparse.Namespace) -> int:
    model, lengths, _ = gather(lambda: model_source(args.model, weights=False),
                               lambda: _lengths(args.max_length),
                               lambda: source(Path(args.path).expanduser(), "PATH", GIVE))
    model.check_lengths(list(lengths), "--max-length")  # as search and plan refuse it
    out = Path(args.out) if args.out else default_out(args.path)
    output_folder(out, "--out" if args.out else "autofit data", "Give a folder (created if missing) for "
                  "lengths.png, data.json and the caches with --out.")
    if looks_like_preferences(args.path):
        ignored = [flag for flag, given in (("--text-field", args.text_field is not None),
                                            ("--messages-field", args.messages_field is not None),
                                            ("--text-mode", args.text_mode != "auto")) if given]
        if ignored:  # TRL's preference formats name their fields: prompt, chosen, rejected
            warn(f"{' and '.join(ignored)} ignored: {shown(args.path)} holds preference pairs, read from their "
                 "'prompt', 'chosen' and 'rejected' fields as TRL reads them")
        return _preferences(args, model, out, lengths)
    try:
        summary = summarize(args.path, model, out, *data_fields(args), TextMode(args.text_mode),
                            lengths, flag="PATH")
    except OSError as e:
        raise CannotWrite(f"{'--out' if args.out else 'autofit data'}: cannot write to {shown(out)} "
                          f"({e.strerror or e}); give a writable folder with --out.") from None
    if summary.data.bad.count:
        warn(f"{shown(args.path)}: {summary.data.bad.summary()}")
    print(json.dumps(summary.to_dict(), indent=1) if args.json else summary.text)
    return 0


def _preferences(args: argparse.Namespace, model: ModelSource, out: Path, lengths: tuple[int, ...]) -> int:
    """Preference pairs (rows with chosen and rejected): the lengths of prompt, chosen and rejected, and what
    each max_length drops (a prompt that fills it) and truncates."""
    try:
        summary = summarize_preferences(args.path, model, out, lengths, flag="PATH")
    except OSError as e:
        raise CannotWrite(f"{'--out' if args.out else 'autofit data'}: cannot write to {shown(out)} "
                          f"({e.strerror or e}); give a writable folder with --out.") from None
    print(json.dumps(summary.to_dict(), indent=1) if args.json else summary.text)
    return 0


def _lengths(values: list[str] | None) -> tuple[int, ...]:
    """--max-length's candidates, spaced or as search's comma list (1024 2048, or 1024,2048)."""
    out = []
    for part in (x.strip() for v in values or () for x in v.split(",")):
        if not part.isdigit() or int(part) <= 0:
            raise UsageError(f"--max-length: {part or repr(part)} is not a length; give positive token counts "
                             "such as 1024 2048 (or 1024,2048).")
        out.append(int(part))
    return tuple(out)


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    dp = sub.add_parser("data", help="length percentiles, histogram and truncation of a dataset",
                        formatter_class=fmt, epilog=DATA_EPILOG)
    dp.add_argument("path", metavar="PATH",
                    help="JSONL (text or messages), text file, save_to_disk folder or parquet")
    dp.add_argument("--model", required=True,
                    help="preset, local folder, config.json, or hub id (its tokenizer)")
    add_data_flags(dp, with_dataset=False)
    dp.add_argument("--max-length", nargs="+", metavar="N",
                    help="the max_length candidates to show instead of the data's own")
    dp.add_argument("--out", metavar="DIR", help="where lengths.png, data.json and the caches go "
                                                 "(default ./autofit-data/<name>-<hash>)")
    dp.add_argument("--json", action="store_true", help="print one JSON object")
    dp.set_defaults(func=cmd_data)
