"""Exporters: a run's winner as a recipe for the tools people already use.

Each format module has `render(run: ExportRun) -> Rendered`. The output never imports autofit.
"""

from __future__ import annotations

from .common import ExportRun, Rendered, export_run, load_run

FORMATS = ("hf-trainer", "trl", "axolotl", "llama-factory")

__all__ = ["FORMATS", "ExportRun", "Rendered", "export_run", "load_run"]
