"""The package's shape: each package is a layer, a module imports only its own layer or lower ones, never in
a cycle (the layer list: tests/support/layers.py)."""

from __future__ import annotations

from pathlib import Path

from layers import CHILD_MAY_IMPORT, PACKAGE, child_side, graph, imports, layer, modules


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


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    """The walker sees a deferred upward import (a module that reaches the CLI from inside a function), and a
    module of the runner's side seen from the child."""
    bad = tmp_path / "units.py"
    bad.write_text("def f():\n    from ..cli import main\n    from autofit.search import driver\n")
    assert imports("autofit.core.units", bad) == {"autofit.cli", "autofit.search.driver"}
    assert layer("autofit.core.units") < layer("autofit.cli") and layer("autofit.search.driver") == 6
    assert child_side("autofit.probe.child.measure") and not child_side("autofit.probe.runner")
