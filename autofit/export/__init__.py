"""Exporters: a run's winner as a recipe for the tools people already use.

Each format module has `render(run: ExportRun) -> Rendered`. The output never imports autofit.
Importing this package imports no ML library: the Python formats check their fields against the
installed transformers/peft/trl inside `render`, at export time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autofit.core.errors import UsageError
from autofit.export import axolotl, hf_trainer, llama_factory, trl
from autofit.export.common import (
    ExportRun,
    Rendered,
    load_run,
    stdout_notes,
    write_rendered,
)
from autofit.run.report.lines import default_format

RENDERERS: dict[str, Callable[[ExportRun], Rendered]] = {
    "hf-trainer": hf_trainer.render, "trl": trl.render, "axolotl": axolotl.render,
    "llama-factory": llama_factory.render,
}
FORMATS = tuple(RENDERERS)
SCRIPTS = ("hf-trainer", "trl")
"""Formats that write a Python script (made executable)."""


def export_run(run: str | Path, fmt: str | None, dataset: str | None = None) -> Rendered:
    """The run's winner rendered in `fmt` (None: the winner's default, `default_format`; on its dataset, from
    `dataset` where the file moved); a bad format, run folder or dataset is a UsageError."""
    if fmt is not None and fmt not in RENDERERS:
        raise UsageError(f"--format: {fmt!r} is not known; expected one of {', '.join(FORMATS)}.")
    loaded = load_run(run, dataset)
    fmt = fmt or default_format(loaded.config.trainer)
    rendered = RENDERERS[fmt](loaded)
    rendered.notes = [*loaded.notes, *rendered.notes]
    rendered.format = fmt
    return rendered


__all__ = ["FORMATS", "SCRIPTS", "ExportRun", "Rendered", "export_run", "load_run", "stdout_notes",
           "write_rendered"]
