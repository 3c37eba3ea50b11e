"""The package's layers: the one copy of the layer list, and the imports of each module read from its source.

tests/unit/test_architecture.py checks that no module imports upward or in a cycle; tests/e2e/test_imports.py
that importing any module but the probe's child side imports no training library. Each package's
`__init__.py` says what it holds.
"""

from __future__ import annotations

import ast
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
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from autofit.run import locks`: module locks
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
