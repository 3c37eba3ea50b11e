"""The dataset reference stored with a run (spec.yaml / best.json), so that `export` and `regress`
read the same data the search measured, and a changed file is reported as changed, not as a
regression."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from pathlib import Path

from autofit.core import paths
from autofit.core.documents import JSONObject
from autofit.core.errors import UsageError
from autofit.data.loading import SampleSet, TextMode, load_samples
from autofit.data.preference import PreferenceSet, read_preferences

SAMPLES = "samples"
PREFERENCE = "preference"
"""`DatasetRef.kind`: samples for supervised fine-tuning (`data/loading.py`), preference pairs for DPO
(`data/preference.py`); each is read again with its own reader."""


class RefState(enum.Enum):
    SAME = "same"
    CHANGED = "changed"
    MISSING = "missing"

    @property
    def usable(self) -> bool:
        return self is RefState.SAME


@dataclass(frozen=True)
class DatasetRef:
    path: str
    content_hash: str
    text_field: str = "text"
    messages_field: str = "messages"
    text_mode: str = TextMode.AUTO.value
    samples: int = 0
    """Samples, or preference pairs, the file held."""
    kind: str = SAMPLES

    @classmethod
    def of(cls, data: SampleSet, text_field: str = "text", messages_field: str = "messages") -> DatasetRef:
        mode = data.text_mode.value if data.text_mode else TextMode.AUTO.value
        return cls(str(Path(data.path).resolve()), data.content_hash, text_field, messages_field, mode,
                   len(data))

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: JSONObject) -> DatasetRef:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})  # a run before `kind`: samples

    @classmethod
    def of_preferences(cls, prefs: PreferenceSet) -> DatasetRef:
        return cls(str(Path(prefs.path).resolve()), prefs.content_hash, samples=len(prefs), kind=PREFERENCE)

    @property
    def preference(self) -> bool:
        return self.kind == PREFERENCE

    def load(self, path: str | None = None) -> tuple[RefState, SampleSet | None]:
        """Read the data again (from `path` if the file moved) and say whether it is the same. The samples come
        back for a samples file only: preference pairs are the DPO probe's to read (`probe/child/dpo.py`)."""
        state, data = self._read(path)
        return state, data if isinstance(data, SampleSet) else None

    def _read(self, path: str | None = None) -> tuple[RefState, SampleSet | PreferenceSet | None]:
        """The state and what its reader read (None: missing or unreadable)."""
        where = self._where(path)
        try:
            if not Path(where).exists():
                return RefState.MISSING, None
        except OSError:  # a name too long for the file system: nothing the run measured is there
            return RefState.MISSING, None
        try:
            data = self._reader(where)
        except UsageError:
            return RefState.CHANGED, None
        return (RefState.SAME if data.content_hash == self.content_hash else RefState.CHANGED), data

    def _where(self, path: str | None) -> str:
        return str(Path(path).expanduser()) if path else self.path

    def _reader(self, where: str) -> SampleSet | PreferenceSet:
        """The file read by its kind's reader (a UsageError naming the file where it cannot be read)."""
        if self.preference:
            return read_preferences(where)
        return load_samples(where, self.text_field, self.messages_field, TextMode(self.text_mode))

    def found(self, path: str | None = None, measured: str = "the run was measured on",
              note: str = "") -> DatasetRef:
        """This reference, read again (from `path` where the file moved): the same content, else a
        UsageError that says what changed and what to do (a changed file is not a regression)."""
        if path:  # a FIFO, a device, a symlink loop, a name too long: said as such
            paths.source(Path(path).expanduser(), "--dataset", "Give the file the run was measured on.")
        state, data = self._read(path)
        if state is RefState.CHANGED and data is None:  # unreadable, not changed: its reader says why
            try:
                self._reader(self._where(path))
            except UsageError as e:
                raise UsageError([p if p.startswith("--dataset") else f"--dataset: {p}" for p in e.problems]) from None
        if state is RefState.MISSING and path:
            raise UsageError(f"--dataset: no such file or folder: {path}. Give the file the run was measured "
                             f"on ({self.path}) at its new place.")
        if state is RefState.MISSING:
            raise UsageError(f"--dataset: the run's dataset {self.path} is missing; give its new place "
                             "with --dataset PATH.")
        if state is RefState.CHANGED or data is None:
            what = (f"{path} does not have the content" if path and Path(path).expanduser().resolve()
                    != Path(self.path) else f"{path or self.path} no longer has the content")
            raise UsageError(f"dataset changed since the run: {what} {measured} (hash "
                             f"{self.content_hash[:12]}, from {self.path}); {note}give that file, or search "
                             "again on the new data.")
        if not path:
            return self
        if isinstance(data, SampleSet):
            return DatasetRef.of(data, self.text_field, self.messages_field)
        return DatasetRef.of_preferences(data)


def stored_dataset(stored: DatasetRef | None, path: str | None = None,
                   measured: str = "the run was measured on", note: str = "") -> DatasetRef | None:
    """The dataset a run's spec names (`RunSpec.dataset`), read again (from `path` where it moved); None for a
    run searched on random tokens, where a `path` is a usage error."""
    if stored is None:
        if path:
            raise UsageError("--dataset: this run was searched on random tokens; it has no dataset to "
                             "replace. Search with --dataset to measure on your data.")
        return None
    return stored.found(path, measured, note)

