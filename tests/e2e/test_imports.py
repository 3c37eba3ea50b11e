"""What a fresh interpreter imports: torch and the training libraries only on the probe's child side, so that
the command line, the planning side of the data, the kernel reasons and the exporters start in a second and
run where no training library is installed. Each test starts its own Python: a module another test imported
into this process would hide the import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT
from layers import child_side, modules

from runs import D1


def fresh(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -c code args` in a new interpreter, on this checkout's package."""
    return subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_importing_every_module_but_the_child_side_imports_no_torch() -> None:
    names = [m for m in modules() if not child_side(m) and m != "autofit.__main__"]
    code = ("import importlib, json, sys\n"
            "heavy = ('torch', 'transformers.modeling_utils', 'peft', 'trl')\n"
            "for m in json.loads(sys.argv[1]):\n"
            "    importlib.import_module(m)\n"
            "    found = [h for h in heavy if h in sys.modules]\n"
            "    if found:\n"
            "        print(m, found)\n"
            "        break\n")
    proc = fresh(code, json.dumps(names))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"imported a training library: {proc.stdout}"
    assert "autofit.export" in names and "autofit.run.session" in names and "autofit.cli.search" in names


def test_importing_the_cli_does_not_import_torch() -> None:
    out = fresh("import sys, autofit.cli, autofit.run.session; print('torch' in sys.modules)")
    assert out.stdout.strip() == "False", out.stderr


def test_the_planning_side_of_the_data_does_not_import_torch() -> None:
    """Not only imported: a dataset loaded, its lengths counted and every strategy planned."""
    code = ("import sys; import autofit.data as d; from autofit.config.models import resolve_model;"
            f"s = d.load_samples({str(D1)!r});"
            "t = d.length_table(s, d.tokenizer_for(resolve_model('tiny-llama'), s));"
            "d.length_stats(t); [d.plan(b, t.lengths, 512, 4) for b in d.Batching];"
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    proc = fresh(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_kernel_reasons_do_not_import_torch() -> None:
    out = fresh("import sys, autofit.config.kernels as k; k.kernel_support(k, 'cuda');"
                "print('torch' in sys.modules)")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_importing_the_exporters_imports_no_ml_library() -> None:
    exporters = [f"autofit.export.{m.stem}" for m in (ROOT / "autofit" / "export").glob("*.py")]
    names = ["autofit.export", *exporters, "autofit.cli.export", "autofit.run.regress", "autofit.cli.regress"]
    code = ("import importlib, sys\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            "heavy = ('torch', 'transformers', 'peft', 'trl', 'bitsandbytes')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    proc = fresh(code)
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr
