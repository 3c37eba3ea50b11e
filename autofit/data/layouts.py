"""Where a plan gets the layouts that the libraries decide: TRL's packed rows (which samples share a row)
and transformers' length-grouped order (`library.py`).

Those libraries import torch. A process that has imported it already (the probe child, a test) computes
them here through `library`; any other (the search, `autofit plan`: processes that must not import
torch) asks one child, `python -m autofit.data.library`, for every layout a search of this data is
likely to need at once (each max_length the data suggests, the usual micro-batch and step sizes), and
keeps them, in memory and, given a folder, on disk beside the length table (`layouts-<key>.json`), so a
search pays for the child's imports once per dataset. A layout depends only on the lengths, the
max_length, the grouping's batch size and the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from autofit.core.documents import JSONObject
from autofit.core.files import write_atomic
from autofit.core.paths import python_module
from autofit.data.stats import candidates

GROUP_SIZES = (1, 2, 4, 8, 16)
"""Batch sizes whose grouped order a child computes along with the one asked: the micro-batches and the
samples per step (micro-batch x accumulation, 16 at the default global batch) that searches use most, so
one child serves most searches (another size costs another child)."""


class Layouts:
    """The libraries' layouts of one length table (module docstring)."""

    def __init__(self, lengths: Sequence[int], seed: int = 0, cache_dir: str | Path | None = None) -> None:
        self.lengths = tuple(int(n) for n in lengths)
        self.seed = seed
        self.key = hashlib.sha256(f"{self.lengths}|{seed}".encode()).hexdigest()[:20]
        self.path = Path(cache_dir) / f"layouts-{self.key}.json" if cache_dir is not None else None
        self._packed: dict[int, list[tuple[int, ...]]] = {}
        self._grouped: dict[tuple[int, int], list[int]] = {}
        self._lock = threading.Lock()
        self._read_cache()

    def bins(self, max_length: int) -> list[tuple[int, ...]]:
        """TRL's packed rows of max_length: the samples of each row, in TRL's order."""
        with self._lock:
            if max_length not in self._packed:
                self._fetch({max_length}, set())
            return self._packed[max_length]

    def grouped(self, max_length: int, batch_size: int) -> list[int]:
        """transformers' length-grouped order of the samples cut to max_length, for batches of batch_size."""
        max_length = min(max_length, max(self.lengths, default=1))  # beyond the longest sample nothing is cut
        with self._lock:
            if (max_length, batch_size) not in self._grouped:
                self._fetch(set(), {(max_length, batch_size)})
            return self._grouped[(max_length, batch_size)]

    def prefetch(self, max_lengths: Iterable[int], batch_sizes: Iterable[int] = ()) -> None:
        """Every layout a search over these lengths and batch sizes will ask for (with `_likely`'s), in one
        child: a space's lengths beyond the data's candidates would otherwise cost a child each."""
        longest = max(self.lengths, default=1)
        with self._lock:
            packed = {n for n in max_lengths if n not in self._packed}
            grouped = {(min(n, longest), b) for n in max_lengths for b in {*GROUP_SIZES, *batch_sizes}}
            grouped -= set(self._grouped)
            if packed or grouped:
                self._fetch(packed, grouped)

    def _fetch(self, packed: set[int], grouped: set[tuple[int, int]]) -> None:
        if "torch" in sys.modules:  # the libraries cost nothing more to import here: no child
            from autofit.data import library

            for n in packed:
                self._packed[n] = library.packed_bins(self.lengths, n)
            for n, b in grouped:
                self._grouped[(n, b)] = library.grouped_order([min(x, n) for x in self.lengths], b, self.seed)
            return
        self._ask_child(*self._likely(packed, grouped))

    def _likely(self, packed: set[int], grouped: set[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """What was asked, with what a search of this data will ask next: every max_length known (the data's
        candidates, which a search on the data searches, and those asked before), packed and grouped by
        every size of GROUP_SIZES."""
        longest = max(self.lengths, default=1)
        lengths = sorted({*packed, *(n for n, _ in grouped), *self._packed, *(n for n, _ in self._grouped),
                          *candidates(sorted(self.lengths), None)})
        sizes = sorted({*GROUP_SIZES, *(b for _, b in grouped)})
        cuts = sorted({min(n, longest) for n in lengths})  # grouping past the longest sample is the same
        return ([n for n in lengths if n not in self._packed],
                [(n, b) for n in cuts for b in sizes if (n, b) not in self._grouped])

    def _ask_child(self, packed: Iterable[int], grouped: Iterable[tuple[int, int]]) -> None:
        request = {"lengths": self.lengths, "seed": self.seed, "packed": list(packed),
                   "grouped": [list(k) for k in grouped]}
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds the autofit package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
               "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        proc = subprocess.run(python_module("autofit.data.library"), input=json.dumps(request),
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"the batching layouts' child (python -m autofit.data.library) exited "
                               f"{proc.returncode}: {tail}")
        self._merge(json.loads(proc.stdout))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(self._document()))

    def _merge(self, doc: JSONObject) -> None:
        for n, bins in doc.get("packed", {}).items():
            self._packed[int(n)] = [tuple(int(i) for i in b) for b in bins]
        for k, order in doc.get("grouped", {}).items():
            n, b = k.split(":")
            self._grouped[(int(n), int(b))] = [int(i) for i in order]

    def _document(self) -> dict[str, object]:
        return {"key": self.key, "packed": {str(n): [list(b) for b in v] for n, v in self._packed.items()},
                "grouped": {f"{n}:{b}": v for (n, b), v in self._grouped.items()}}

    def _read_cache(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("key") == self.key:
                self._merge(doc)
        except (ValueError, KeyError, TypeError, AttributeError):
            self._packed, self._grouped = {}, {}  # a damaged cache is computed again


_SHARED: dict[tuple[str, int, str | None], Layouts] = {}
_SHARED_LOCK = threading.Lock()


def layouts_for(lengths: Sequence[int], seed: int = 0, cache_dir: str | Path | None = None) -> Layouts:
    """One Layouts per length table, seed and folder in this process: plans of the same data share the
    child's answers."""
    key = (hashlib.sha256(str(tuple(int(n) for n in lengths)).encode()).hexdigest(), seed,
           str(cache_dir) if cache_dir is not None else None)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Layouts(lengths, seed, cache_dir)
        return _SHARED[key]
