"""Cards people rent or own, with their memory as the driver reports it to a program (what
`torch.cuda.get_device_properties(0).total_memory` or CUDA's deviceQuery prints): less than the label, which
counts decimal gigabytes or memory the driver keeps for itself. `autofit plan --card NAME` plans for one of
them; `--card all` for each.

Each figure names where it was read (`source`). A card whose printed figure was not found is marked
`estimated` with its reasoning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autofit.core.errors import UsageError

MIB = 2**20


@dataclass(frozen=True)
class Card:
    name: str
    label: str
    """As sold: "24 GB"."""
    total_bytes: int
    """As the driver reports it to a program."""
    source: str
    estimated: bool = False

    def matches(self, text: str) -> bool:
        return _norm(text) in {_norm(self.name), *(_norm(a) for a in _ALIASES.get(self.name, ()))}


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower().replace("geforce", "").replace("nvidia", "").replace("tesla", ""))


CARDS: tuple[Card, ...] = (
    Card("T4", "16 GB", 15_843_721_216, "CUDA deviceQuery on a Tesla T4: \"Total amount of global memory: 15110 "
         "MBytes (15843721216 bytes)\" (chiemon.github.io, 2024-12-25, NVIDIA 显卡信息)"),
    Card("L4", "24 GB", 23_034 * MIB, "nvidia-smi: 23034MiB", estimated=True),
    Card("A10", "24 GB", 23_028 * MIB, "nvidia-smi: 23028MiB", estimated=True),
    Card("RTX 3090", "24 GB", 24_576 * MIB, "nvidia-smi: 24576MiB", estimated=True),
    Card("RTX 4090", "24 GB", 24_564 * MIB, "nvidia-smi: 24564MiB", estimated=True),
    Card("RTX 5090", "32 GB", 32_607 * MIB, "nvidia-smi: 32607MiB", estimated=True),
    Card("A100 40GB", "40 GB", 40_960 * MIB, "nvidia-smi: 40960MiB", estimated=True),
    Card("A100 80GB", "80 GB", 81_920 * MIB, "nvidia-smi: 81920MiB", estimated=True),
    Card("H100", "80 GB", 81_559 * MIB, "nvidia-smi: 81559MiB", estimated=True),
    Card("H200", "141 GB", 143_771 * MIB, "nvidia-smi: 143771MiB", estimated=True),
    Card("B200", "180 GB", 183_359 * MIB, "nvidia-smi: 183359MiB", estimated=True),
)
_ALIASES = {"A10": ("A10G",), "A100 40GB": ("A100", "A100-40", "A100 40"), "A100 80GB": ("A100-80", "A100 80"),
            "H100": ("H100 80GB",), "T4": ("Tesla T4",), "RTX 3090": ("3090",), "RTX 4090": ("4090",),
            "RTX 5090": ("5090",)}
ALL = "all"


def cards(name: str, flag: str = "--card") -> tuple[Card, ...]:
    """The card named (its name or a common alias, any case and spacing), or every card for `all`."""
    if _norm(name) == ALL:
        return CARDS
    found = tuple(c for c in CARDS if c.matches(name))
    if not found:
        raise UsageError(f"{flag}: {name!r} is not a card autofit knows; known: {', '.join(c.name for c in CARDS)}, "
                         "or all. For another card give --memory-limit with its memory (as nvidia-smi reports it, "
                         "for example 24564MiB).")
    return found
