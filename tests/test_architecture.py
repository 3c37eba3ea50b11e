"""The package's shape: layers that import only downward, no cycles, torch only on the probe side.

Layers, bottom to top (a module imports its own layer or lower ones, never a cycle):
  0 foundation   errors, files, paths, protocol, units, result, envinfo, spec, models, signatures, objective
  1 domain       space, memory, recipe, target, kills (evidence of the OOM killer), data (datasets,
                 lengths, batching), kernels (what kernels can run, the correctness gate), distributed
                 (the engines of a probe spanning several GPUs), group (its ranks judged as one)
  2 run & probes rundir (the run folder), locks (who measures a run folder now), runner (the parent side of the process boundary), report,
                 study (the Optuna study: rows, repeats), knowledge (what is known: pruning)
  3 workflows    search (and its parts), regress, export
  4 session      session (what `search` starts, resumes or joins)
  5 interface    cli, __main__, _entry (the command's entry point)
The probe side (autofit.probe*) runs in the child process: it imports layers 0-1 only, and no
module imports it (the runner starts it as a command).
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
LAYERS = {
    0: ("errors", "files", "paths", "protocol", "units", "result", "envinfo", "spec", "models", "signatures", "objective"),
    1: ("space", "memory", "effects", "recipe", "target", "kills", "data", "kernels", "distributed", "group"),
    2: ("rundir", "locks", "runner", "report", "study", "knowledge", "policy"),
    3: ("search", "regress", "export", "replay"),
    4: ("session",),
    5: ("cli", "__main__", "_entry"),
}
PROBE_SIDE = "probe"
PROBE_MAY_IMPORT = 1


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
            out.add(str(node.module))
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("autofit")}
    known = modules()
    return {_owner(m, known) for m in out if _owner(m, known)} - {name}


def _owner(target: str, known: dict[str, Path]) -> str:
    """`autofit.export.FORMATS` -> `autofit.export`: the longest module name the target starts with."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def top(name: str) -> str:
    """`autofit.cli.search` -> `cli`; `autofit.probe_memory` -> `probe` (the probe side)."""
    first = name.split(".")[1] if "." in name else ""
    return PROBE_SIDE if first.startswith(PROBE_SIDE) else first


def layer(name: str) -> int | None:
    if name == "autofit":
        return 0
    return next((n for n, names in LAYERS.items() if top(name) in names), None)


def graph() -> dict[str, set[str]]:
    return {name: imports(name, path) for name, path in modules().items()}


def test_every_module_has_a_layer() -> None:
    missing = [m for m in modules() if top(m) != PROBE_SIDE and layer(m) is None]
    assert not missing, f"add these modules to LAYERS (and to the layers in the README): {missing}"


def test_no_module_imports_upward() -> None:
    upward = []
    for name, deps in graph().items():
        mine = PROBE_MAY_IMPORT if top(name) == PROBE_SIDE else layer(name)
        for dep in deps:
            theirs = layer(dep)
            if top(dep) == PROBE_SIDE and top(name) != PROBE_SIDE:
                upward.append(f"{name} imports the probe side ({dep}); start it as a process instead")
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


def test_importing_every_module_but_the_probe_side_imports_no_torch() -> None:
    names = [m for m in modules() if top(m) != PROBE_SIDE and m != "autofit.__main__"]
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
    assert "autofit.export" in names and "autofit.session" in names and "autofit.cli.search" in names


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    """The walker sees a deferred upward import (a module that reaches the CLI from inside a function)."""
    bad = tmp_path / "units.py"
    bad.write_text("def f():\n    from .cli import main\n    from . import search\n")
    assert imports("autofit.units", bad) == {"autofit.cli", "autofit.search"}
    assert layer("autofit.units") < layer("autofit.cli")
