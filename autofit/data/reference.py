"""The dataset reference stored with a run (spec.yaml / best.json), so that `export` and `regress`
read the same data the search measured, and a changed file is reported as changed, not as a
regression."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .loading import SampleSet, TextMode, load_samples


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

    @classmethod
    def of(cls, data: SampleSet, text_field: str = "text", messages_field: str = "messages") -> DatasetRef:
        mode = data.text_mode.value if data.text_mode else TextMode.AUTO.value
        return cls(str(Path(data.path).resolve()), data.content_hash, text_field, messages_field, mode,
                   len(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetRef:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def load(self, path: str | None = None) -> tuple[RefState, SampleSet | None]:
        """Read the data again (from `path` if the file moved) and say whether it is the same."""
        where = path or self.path
        if not Path(where).exists():
            return RefState.MISSING, None
        try:
            data = load_samples(where, self.text_field, self.messages_field, TextMode(self.text_mode))
        except UsageError:
            return RefState.CHANGED, None
        return (RefState.SAME if data.content_hash == self.content_hash else RefState.CHANGED), data
