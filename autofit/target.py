"""Where probes run: the CPU or one GPU, with an optional memory limit (an emulated card)."""

from __future__ import annotations

from dataclasses import dataclass

from .envinfo import gpus
from .errors import UsageError
from .protocol import HEADROOM, usable_bytes
from .units import format_size, parse_size


@dataclass(frozen=True)
class Target:
    """Where probes run: the CPU, or one GPU (physical index) with an optional memory limit."""

    device: str = "cpu"
    gpu_index: int | None = None
    gpu_name: str = ""
    memory_limit_bytes: int | None = None
    headroom: float = HEADROOM

    def describe(self, long: bool = False) -> str:
        """`cuda:0 NVIDIA H200, 40 GiB limit`; `long` adds what memory means on the CPU (for results)."""
        lim = f", {format_size(self.memory_limit_bytes)} limit" if self.memory_limit_bytes else ""
        if self.device == "cpu":
            return f"cpu (no GPU: memory is host RSS added by the probe{lim})" if long else f"cpu{lim}"
        return f"cuda:{self.gpu_index} {self.gpu_name}{lim}"

    @property
    def usable_bytes(self) -> int | None:
        """The memory a peak may reach: the limit less the headroom (None without a limit)."""
        return usable_bytes(self.memory_limit_bytes, self.headroom)


def resolve_targets(gpu: str | None, device: str | None, memory_limit: str | None,
                    headroom: float = HEADROOM) -> list[Target]:
    """--gpu / --device / --memory-limit -> one Target per worker."""
    limit = parse_size(memory_limit) if memory_limit else None
    if not 0 <= headroom < 0.5:
        raise UsageError(f"--headroom: {headroom} is out of range; expected a fraction such as 0.05.")
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device: {device!r} is not known; expected cpu or cuda.")
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other; give one of them.")
    found = {g.index: g for g in gpus()} if device != "cpu" else {}
    if gpu is None and (device == "cpu" or not found):
        if device == "cuda":
            raise UsageError("--device cuda: no NVIDIA GPU is visible here; use --device cpu.")
        return [Target("cpu", None, "", limit, headroom)]
    try:
        wanted = [int(x) for x in (gpu or "0").split(",") if x.strip() != ""]
    except ValueError:
        raise UsageError(f"--gpu: {gpu!r} is not a GPU index list; expected for example 0 or 0,1.") from None
    if not wanted or len(set(wanted)) != len(wanted):
        raise UsageError(f"--gpu: {gpu!r} must name each GPU once, for example 0 or 0,1.")
    problems = []
    for i in wanted:
        if i not in found:
            have = ", ".join(str(k) for k in sorted(found)) or "none"
            problems.append(f"--gpu: GPU {i} does not exist here (GPUs: {have}); "
                            "see `autofit env`, or use --device cpu.")
        elif limit and limit > found[i].memory_bytes:
            problems.append(f"--memory-limit: {memory_limit} is more than GPU {i} has "
                            f"({found[i].memory_bytes / 2**30:.1f} GiB); give a smaller limit.")
    if problems:
        raise UsageError(problems)
    return [Target("cuda", i, found[i].name, limit, headroom) for i in wanted]
