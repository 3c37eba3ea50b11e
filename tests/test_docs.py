"""The docs say what the code and the measurements hold.

- The fault table (docs/failures.md) is the one the fault suite declares, and the key table (docs/probe.md)
  the one the configuration's declaration prints.
- Every figure in the README's headline tables is recomputed from the JSON file cited beside it.
- Every link resolves, every module path the docs name exists, and the README's two commands, set-up and
  test, are ones CI runs, in that order.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def printed(script: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script)], capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout.strip().splitlines()


def assert_holds_table(page: Path, lines: list[str], script: str) -> None:
    """`page` holds the table lines `script` prints, in one block and in order."""
    table = [line for line in lines if line.startswith("|")]
    text = page.read_text().splitlines()
    assert table[0] in text, f"{page.name} has no table headed {table[0]!r}: paste python scripts/{script}"
    start = text.index(table[0])
    differs = f"{page.name}'s table differs: paste python scripts/{script}"
    assert text[start:start + len(table)] == table, differs


def test_the_fault_table_is_the_fault_suites() -> None:
    lines = printed("fault_table.py")
    assert_holds_table(DOCS / "failures.md", lines, "fault_table.py")
    totals = lines[-1]
    assert totals in (DOCS / "failures.md").read_text(), totals
    count = totals.split()[0]
    assert f"({count} faults and bad inputs" in README.read_text(), f"the README should count {count} faults"


def test_the_key_table_is_the_declarations() -> None:
    assert_holds_table(DOCS / "probe.md", printed("key_table.py"), "key_table.py")


# --- the headline figures --------------------------------------------------------------------------------

def pick(doc: Any, path: str) -> list[float]:
    """The numbers at `path` in a JSON document: `a.b[0].c`, with `[*]` for every item of a list."""
    found = [doc]
    for part in re.findall(r"\[\*\]|\[\d+\]|[^.\[\]]+", path):
        if part == "[*]":
            found = [item for value in found for item in value]
        elif part.startswith("["):
            found = [value[int(part[1:-1])] for value in found]
        else:
            found = [value[part] for value in found]
    return [float(v) for v in found]


@dataclass(frozen=True)
class Measured:
    """A figure read from one results file: one value, the median of several, or their spread (max/min)."""

    file: str
    path: str
    how: str = "one"
    unit: str = "tokens/s"
    """tokens/s (shown as 12,345), bytes or GiB (shown as 12.3 GiB)."""

    def files(self) -> set[str]:
        return {self.file}

    def value(self) -> float:
        values = pick(json.loads((RESULTS / self.file).read_text()), self.path)
        if self.how == "one":
            assert len(values) == 1, (self.file, self.path)
            return values[0]
        return statistics.median(values) if self.how == "median" else max(values) / min(values)

    def shown(self) -> str:
        v = self.value()
        if self.how == "spread":
            return f"{v:.2f}x"
        if self.unit == "tokens/s":
            return f"{round(v):,}"
        return f"{v / 2**30 if self.unit == 'bytes' else v:.1f} GiB"


@dataclass(frozen=True)
class Ratio:
    num: Measured
    den: Measured

    def files(self) -> set[str]:
        return self.num.files() | self.den.files()

    def shown(self) -> str:
        return f"{self.num.value() / self.den.value():.2f}x"


HEAD = "headline-s1.json"
S1D2, S2D2 = "data-bench-s1-d2.json", "data-bench-s2-d2.json"


def repeats(file: str, pair: str, side: str) -> tuple[Measured, Measured]:
    """One side of a data bench pair measured again in fresh processes: the median of its runs, their spread."""
    runs = f"pairs.{pair}.repeats.{side}.runs[*].tokens_per_s"
    return Measured(file, runs, "median"), Measured(file, runs, "spread")


def data_row(file: str, pair: str) -> tuple[Measured | Ratio, ...]:
    baseline, searched = repeats(file, pair, "baseline"), repeats(file, pair, "searched")
    return *baseline, *searched, Ratio(searched[0], baseline[0])


def head_row(label: str) -> tuple[Measured, Measured, Measured]:
    """A configuration of the one-call headline: the median of its runs, their spread and the median peak."""
    runs = f"configs.{label}.runs[*]"
    return (Measured(HEAD, f"{runs}.tokens_per_s", "median"), Measured(HEAD, f"{runs}.tokens_per_s", "spread"),
            Measured(HEAD, f"{runs}.peak_gib", "median", "GiB"))


def peer_row(file: str, scenario: str) -> tuple[Measured | Ratio, ...]:
    """Unsloth's recipe and autofit's winner of one scenario: each side's median, spread and median peak."""
    sides = [(Measured(file, f"scenarios.{scenario}.{who}.runs[*].tokens_per_s", "median"),
              Measured(file, f"scenarios.{scenario}.{who}.runs[*].tokens_per_s", "spread"),
              Measured(file, f"scenarios.{scenario}.{who}.runs[*].peak_gib", "median", "GiB"))
             for who in ("unsloth", "autofit")]
    return *sides[0], *sides[1], Ratio(sides[1][0], sides[0][0])


FORUM_ROW, WINNER_ROW, LIGER_ROW = head_row("forum"), head_row("winner"), head_row("kernel_winner")
HEADLINE: dict[str, tuple[Measured | Ratio, ...]] = {
    "forum recipe: micro-batch 1 + checkpointing": FORUM_ROW,
    "autofit's winner: micro-batch 2, no checkpointing, default allocator (see below), "
    "searched in the same call (69 s)": WINNER_ROW,
    "winner / forum recipe": (Ratio(WINNER_ROW[0], FORUM_ROW[0]),),
    "with Liger kernels: micro-batch 3, no checkpointing (the winner of a resumed kernel search)": LIGER_ROW,
    "Liger winner / winner": (Ratio(LIGER_ROW[0], WINNER_ROW[0]),),
    "stock kernels at that configuration": (
        Measured(HEAD, "configs.stock_at_kernel_config.runs[0].peak_gib", unit="GiB"),),
    "40 GiB": data_row(S1D2, "40GiB/D2"),
    "24 GiB": data_row(S2D2, "24GiB/D2"),
    "S1, 40 GiB, length 2048, 16 samples a step each": peer_row("unsloth-s1-16.json", "S1-16"),
    "S1, Unsloth given the card": peer_row("unsloth-s1-u8.json", "S1-u8"),
    "S1, the searched winner": peer_row("unsloth-s1.json", "S1"),
    "S5, nf4 base, 12 GiB, length 1024": peer_row("unsloth-s5.json", "S5"),
}
"""Each headline row (by its first cell) and how every figure in it is computed from the files it cites."""
FIGURE = re.compile(r"\d{1,3}(?:,\d{3})+|\d+\.\d+x|\d+\.\d+ GiB")
"""What counts as a figure in a row: tokens/s (12,345), ratios and spreads (1.23x), memory (12.3 GiB)."""


def headline_rows() -> list[list[str]]:
    """The body rows of every table above the README's set-up section, as cells."""
    head = README.read_text().split("\n## Set up and test")[0].splitlines()
    rows = []
    for i, line in enumerate(head):
        in_body = i >= 2 and all(row.startswith("|") for row in head[i - 2:i + 1])
        if in_body and not re.fullmatch(r"[|\-: ]+", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_headline_figure_is_the_json_it_cites() -> None:
    rows = headline_rows()
    rows_differ = "the README's headline rows and HEADLINE differ: give each row its figures here"
    assert {r[0] for r in rows} == set(HEADLINE), rows_differ
    for first, *cells in rows:
        text = " | ".join(cells)
        figures = HEADLINE[first]
        want = Counter(f.shown() for f in figures)
        says = Counter(FIGURE.findall(text))
        assert says == want, f"{first}: the README says {text!r}; the JSON gives {dict(want)}"
        cited = set(re.findall(r"\]\(bench/results/([^)#]+)\)", text))
        files = set().union(*(f.files() for f in figures))
        assert cited == files, f"{first}: cites {sorted(cited)}, its figures come from {sorted(files)}"


# --- links, paths, commands ----------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def prose(page: Path) -> str:
    """A page without its fenced code blocks (a `#` there is a comment, a `[x](y)` code)."""
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", prose(page), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_points_to_a_file_that_exists() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            where, _, anchor = target.partition("#")
            path = (page.parent / where).resolve() if where else page
            if not path.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


SOURCES = ("autofit", "tests", "bench", "scripts")
PACKAGES = {p.name for p in (ROOT / "autofit").iterdir() if p.is_dir() and not p.name.startswith("_")}


def module_exists(dotted: str) -> bool:
    """`autofit.config.spec` or `autofit.config.spec.KEYS`: a module, or a name a module defines."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            rest = parts[n:]
            if not rest:
                return True
            defined = rf"^\s*(def |class )?{re.escape(rest[0])}\b"
            return re.search(defined, source.read_text(), re.M) is not None
    return False


def test_every_module_path_the_docs_name_exists() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"autofit/[\w/.]*\w", text):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
        for dotted in re.findall(r"\bautofit(?:\.\w+)+", text):
            if not module_exists(dotted):
                missing.append(f"{page.name}: {dotted}")
        for quoted in re.findall(r"`([\w/]+\.py|[\w/]+/)`", text):
            first = quoted.split("/")[0]
            if first in PACKAGES and not (ROOT / "autofit" / quoted).exists():
                missing.append(f"{page.name}: {quoted} (autofit/{quoted})")
            elif "/" not in quoted and not any(ROOT.glob(f"{d}/**/{quoted}") for d in SOURCES):
                missing.append(f"{page.name}: {quoted}")
    assert not missing, "no such module or file:\n" + "\n".join(missing)


def test_the_readme_set_up_and_test_commands_are_what_ci_runs() -> None:
    section = README.read_text().split("## Set up and test")[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "the README's set-up section has no command block"
    readme = block.group(1).strip().splitlines()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert len(readme) == 2, f"the README's set-up and test are two commands, not {readme}"
    assert readme[0] in ci and readme[1] in ci[ci.index(readme[0]):], f"README: {readme}; .ci/run runs {ci}"
