"""Build the data-aware benchmark corpora deterministically, from text that ships with Python.

D1 (real text): one sample per module, class and function docstring of the Python standard
library, read with `ast` from the source files (nothing is imported), in sorted path order. Each
sample is the qualified name on the first line, then the docstring. `--chat` also writes a chat
variant: user "What does `NAME` do?", assistant the docstring. Naturally long-tailed. Depends on
the Python version (recorded in the meta file).

D2 (synthetic): log-normal lengths in words with mean `D2_MEAN` and 99th percentile `D2_P99`
(sigma and mu solved from those two figures below), clipped to [`D2_MIN`, `D2_MAX`]; each sample
is that many words drawn (seeded) from the 2,000 most common words of D1. With the stand-in BPE
trained on the set itself a word is about one token; with a 32k-vocabulary tokenizer about 1.3.

    python bench/data/make_corpus.py --out bench/data/out            # d1.jsonl d1-chat.jsonl d2.jsonl
    python bench/data/make_corpus.py --out tests/data --slice        # the small committed slice
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import math
import random
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

D2_MEAN = 300.0
D2_P99 = 2000.0
D2_MIN, D2_MAX = 8, 4096
Z99 = 2.3263478740408408  # standard normal quantile at 0.99
# mean = exp(mu + s^2/2), p99 = exp(mu + Z99 s)  =>  s^2/2 - Z99 s + ln(p99/mean) = 0 (smaller root)
D2_SIGMA = Z99 - math.sqrt(Z99 ** 2 - 2 * math.log(D2_P99 / D2_MEAN))
D2_MU = math.log(D2_MEAN) - D2_SIGMA ** 2 / 2
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "__pycache__",
             "dist-packages", "tkinter", "pydoc_data"}
SLICE_EVERY = 80
"""The committed slice keeps every SLICE_EVERY-th D1 sample (and chat row), and D2_SLICE D2 rows."""
D2_SLICE = 60
SLICE_MAX_WORDS = 1200


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def docstrings(path: Path, root: Path) -> Iterator[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    yield from _walk(tree, module)


def _walk(node: Any, name: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(node, clean=True)
    if doc and doc.strip():
        yield name, doc.strip()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _walk(child, f"{name}.{child.name}")


def d1() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [item for path in stdlib_files() for item in docstrings(path, root)]


def d1_rows(items: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    text = [{"text": f"{name}\n\n{doc}"} for name, doc in items]
    chat = [{"messages": [{"role": "user", "content": f"What does `{name}` do?"},
                          {"role": "assistant", "content": doc}]} for name, doc in items]
    return text, chat


def d2(items: list[tuple[str, str]], n: int, seed: int = 0) -> list[dict[str, Any]]:
    counts = collections.Counter(w for _, doc in items for w in re.findall(r"[a-z]+", doc.lower()))
    vocab = [w for w, _ in counts.most_common(2000)]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = min(D2_MAX, max(D2_MIN, round(rng.lognormvariate(D2_MU, D2_SIGMA))))
        rows.append({"text": " ".join(rng.choice(vocab) for _ in range(words))})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--d2-samples", type=int, default=10000)
    ap.add_argument("--slice", action="store_true", help="write the small slice kept under tests/data")
    args = ap.parse_args(argv)
    items = d1()
    text, chat = d1_rows(items)
    synthetic = d2(items, D2_SLICE if args.slice else args.d2_samples)
    if args.slice:
        def short(r: dict[str, Any]) -> bool:
            return len(json.dumps(r).split()) <= SLICE_MAX_WORDS
        text = [r for r in text[::SLICE_EVERY] if short(r)]
        chat = [r for r in chat[SLICE_EVERY // 2::SLICE_EVERY * 4] if short(r)]
    names = ("d1-slice", "d1-chat-slice", "d2-slice") if args.slice else ("d1", "d1-chat", "d2")
    for name, rows in zip(names, (text, chat, synthetic)):
        write_jsonl(args.out / f"{name}.jsonl", rows)
    meta = {"python": sys.version.split()[0], "d1_samples_full": len(items), "d2_mu": D2_MU,
            "d2_sigma": D2_SIGMA, "d2_mean_words": D2_MEAN, "d2_p99_words": D2_P99,
            "files": {n: len(r) for n, r in zip(names, (text, chat, synthetic))}}
    (args.out / ("corpus-slice-meta.json" if args.slice else "corpus-meta.json")).write_text(
        json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
