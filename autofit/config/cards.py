"""Cards people rent or own, with their memory as a program sees it: the CUDA total that
`torch.cuda.get_device_properties(0).total_memory` and CUDA's deviceQuery print. nvidia-smi's memory.total
(what the label rounds) is 300-800 MiB more on current drivers: the driver reserves that much, and it
moves with the driver version, so each figure is the lowest seen across the drivers found.
`autofit plan --card NAME` plans for one of them; `--card all` for each.

Each figure names where it was read (`source`); one whose printed CUDA total was not found is `estimated`,
with its reasoning. Under MIG a program sees its slice only: give `--memory-limit` then.
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
    bf16: bool = True
    """Computes in bf16 (compute capability 8.0 or more): Trainer refuses `bf16=True` on a card without it."""

    def matches(self, text: str) -> bool:
        return _norm(text) in {_norm(self.name), *(_norm(a) for a in _ALIASES.get(self.name, ()))}


def _norm(text: str) -> str:
    low = text.lower().replace("geforce", "").replace("nvidia", "").replace("tesla", "")
    return re.sub(r"[^a-z0-9]", "", low)


GLS = "github.com/thamada/gls (commit e20f22d), deviceQuery beside nvidia-smi on the same host"
CARDS: tuple[Card, ...] = (
    Card("T4", "16 GB", 15_835_398_144,
         "deviceQuery, CUDA 12.0: \"15102 MBytes (15835398144 bytes)\" (router-gao/cuda-demo, "
         "cuda-samples/01-cuda-deviceQuery.md); older drivers show 15843721216", bf16=False),  # Turing, 7.5
    Card("L4", "24 GB", 23_570_219_008,
         f"deviceQuery, driver 550: \"22478 MBytes (23570219008 bytes)\" ({GLS})"),
    Card("A10", "24 GB", 23_595_909_120,
         f"deviceQuery, driver 550: \"22503 MBytes (23595909120 bytes)\" ({GLS})"),
    Card("A10G", "24 GB", 23_595_909_120,
         "no printed CUDA total found; nvidia-smi shows 23028MiB as for the A10 (NVIDIA/DCGM#232), so the "
         "A10's figure", estimated=True),
    Card("RTX 3090", "24 GB", 25_286_672_384,
         "deviceQuery on a desktop (a display attached): \"25286672384 bytes\" "
         f"(Jumperkables/cuda-benchmarking); 25327697920 without a display ({GLS})"),
    Card("RTX 4090", "24 GB", 25_386_352_640,
         f"deviceQuery, driver 550: \"24210 MBytes (25386352640 bytes)\" ({GLS})"),
    Card("RTX 5090", "32 GB", 33_660_534_784,
         "deviceQuery, CUDA 13.0: 33660534784 bytes (noonghunna/club-3090#1107); 33680457728 on driver 570 "
         f"({GLS})"),
    Card("A100 40GB", "40 GB", 42_285_268_992,
         "deviceQuery, A100-PCIE-40GB, CUDA 12.4: \"40326 MBytes (42285268992 bytes)\"; the SXM4 card shows "
         "42481811456 (router-gao/cuda-demo)"),
    Card("A100 80GB", "80 GB", 84_974_239_744,
         "deviceQuery, A100 80GB PCIe, CUDA 12.4: \"81038 MBytes (84974239744 bytes)\"; the SXM4 card shows "
         f"85100068864 on driver 555 ({GLS})"),
    Card("H100", "80 GB", 85_017_755_648,
         "deviceQuery, H100 SXM, driver 580: 85017755648 bytes (LandonTClipp, 2025-10-21); 85045477376 on "
         f"driver 565 ({GLS})"),
    Card("H200", "141 GB", 150_021_734_400,
         f"deviceQuery, driver 550: \"143072 MBytes (150021734400 bytes)\" ({GLS})"),
    Card("B200", "180 GB", 191_502_213_120,
         "no deviceQuery byte count found; cudaGetDeviceProperties printed \"Total Global Memory: "
         "178.35 GB\" (GiB; pytorch/ao PR #4002), nvidia-smi 183359MiB (NVIDIA/TensorRT-LLM#10278)",
         estimated=True),
)
_ALIASES = {"A100 40GB": ("A100", "A100-40", "A100 40"),
            "A100 80GB": ("A100-80", "A100 80"), "H100": ("H100 80GB",), "T4": ("Tesla T4",),
            "RTX 3090": ("3090",), "RTX 4090": ("4090",), "RTX 5090": ("5090",)}
ALL = "all"


def cards(name: str, flag: str = "--card") -> tuple[Card, ...]:
    """The card named (its name or a common alias, any case and spacing), or every card for `all`."""
    if _norm(name) == ALL:
        return CARDS
    found = tuple(c for c in CARDS if c.matches(name))
    if not found:
        known = ", ".join(c.name for c in CARDS)
        raise UsageError(f"{flag}: {name!r} is not a card autofit knows; known: {known}, or all. For another "
                         "card give --memory-limit with its memory (as nvidia-smi reports it, for example "
                         "24564MiB).")
    return found
