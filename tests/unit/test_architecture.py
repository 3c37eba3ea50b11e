"""The package's shape: each package is a layer, a module imports only its own layer or lower ones, never in
a cycle, and torch only on the probe's child side.

This file holds the one copy of the layer list; each package's `__init__.py` says what it holds.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "autofit"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),              # 0 errors and exit codes, units, files written whole, paths, versions
    ("config",),            # 1 TrialConfig and its dimensions, spaces, models, targets, training arguments
    ("protocol",),          # 2 what crosses the process boundary, and how an outcome is judged
    ("data",),              # 3 datasets, lengths, batching plans
    ("estimate",),          # 4 the memory model and the declared speed effects
    ("probe",),             # 5 the parent side of a probe (the runner); its child side is below
    ("search",),            # 6 the driver, knowledge, policy, study, objective, replay
    ("run",),               # 7 the run folder, its locks, the session, the report, regress
    ("export",),            # 8 recipes for the tools people use
    ("cli", "__main__", "_entry"),  # 9 parsing, printing, exit codes
)
CHILD = "probe.child"
"""The probe's child side: the only code that imports torch; it may import layers 0-4 and nothing of the
runner, and no module imports it (the runner starts it as `python -m autofit.probe.child`)."""
CHILD_MAY_IMPORT = 4


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> set[str]:
    """autofit modules that `path` imports, anywhere in it (deferred imports count)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" for a in node.names} if node.module is None else {base}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autofit"):
            mod = str(node.module)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from autofit.run import locks`: the module locks
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("autofit")}
    known = modules()
    return {_owner(m, known) for m in out if _owner(m, known)} - {name}


def _owner(target: str, known: dict[str, Path]) -> str:
    """`autofit.export.FORMATS` -> `autofit.export`: the longest module name the target starts with."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def child_side(name: str) -> bool:
    return name == f"autofit.{CHILD}" or name.startswith(f"autofit.{CHILD}.")


def layer(name: str) -> int | None:
    if name == "autofit":
        return 0
    first = name.split(".")[1] if "." in name else ""
    return next((n for n, names in enumerate(LAYERS) if first in names), None)


def graph() -> dict[str, set[str]]:
    return {name: imports(name, path) for name, path in modules().items()}


def test_every_module_sits_in_a_layer_package() -> None:
    missing = [m for m in modules() if layer(m) is None]
    assert not missing, f"put these modules in a layer's package (LAYERS): {missing}"
    flat = [m for m in modules() if m.count(".") == 1 and m.split(".")[1] not in ("__main__", "_entry")
            and not (PACKAGE / m.split(".")[1]).is_dir()]
    assert not flat, f"a module beside the packages: {flat}; put it in the package of its layer"


def test_no_module_imports_upward() -> None:
    upward = []
    for name, deps in graph().items():
        mine = CHILD_MAY_IMPORT if child_side(name) else layer(name)
        for dep in deps:
            theirs = layer(dep)
            if child_side(dep) and child_side(name):
                continue  # the child side's own modules
            if child_side(dep):
                upward.append(f"{name} imports the probe's child side ({dep}); start it as a process instead")
            elif child_side(name) and not child_side(dep) and theirs == layer("autofit.probe"):
                upward.append(f"{name} (the child side) imports the runner's side ({dep})")
            elif mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{name} (layer {mine}) imports {dep} (layer {theirs})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            # a package's __init__ re-exporting its own submodules is not a cycle of concepts
            if dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep):], dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(g):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


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
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(names)], check=False, capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"imported a training library: {proc.stdout}"
    assert "autofit.export" in names and "autofit.run.session" in names and "autofit.cli.search" in names


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    """The walker sees a deferred upward import (a module that reaches the CLI from inside a function), and a
    module of the runner's side seen from the child."""
    bad = tmp_path / "units.py"
    bad.write_text("def f():\n    from ..cli import main\n    from autofit.search import driver\n")
    assert imports("autofit.core.units", bad) == {"autofit.cli", "autofit.search.driver"}
    assert layer("autofit.core.units") < layer("autofit.cli") and layer("autofit.search.driver") == 6
    assert child_side("autofit.probe.child.measure") and not child_side("autofit.probe.runner")
