"""Where probes run: the CPU or one GPU, with an optional memory limit (an emulated card)."""

from __future__ import annotations

from dataclasses import dataclass

from autofit.core.envinfo import gpus
from autofit.core.errors import UsageError
from autofit.core.units import format_size, parse_size

HEADROOM = 0.05
"""Fraction of the memory limit kept free: a peak inside it does not fit."""


def usable_bytes(limit: int | None, headroom: float = HEADROOM) -> int | None:
    """What a peak may reach under `limit` with `headroom` kept free (None: no limit)."""
    return int(limit * (1 - headroom)) if limit else None


@dataclass(frozen=True)
class Target:
    """Where probes run: the CPU, or GPUs (physical indices) with an optional memory limit per GPU.

    One worker's target: `ranks` GPUs (`gpu_indices`, the first is `gpu_index`) that a probe of up to
    `ranks` GPUs spans (launched with torchrun); on the CPU, `ranks` processes with the gloo backend."""

    device: str = "cpu"
    gpu_index: int | None = None
    gpu_name: str = ""
    memory_limit_bytes: int | None = None
    headroom: float = HEADROOM
    ranks: int = 1
    gpu_indices: tuple[int, ...] = ()
    """Every GPU of the group, `gpu_index` first (empty: the one `gpu_index`, or the CPU)."""
    card_bytes: int | None = None
    """The GPU's own memory as the driver reports it: the limit where none is given (a real 24 GiB card is
    judged as a 24 GiB limit is), so the search's prior and its headroom know the card's size."""

    def __post_init__(self) -> None:
        indices: object = self.gpu_indices  # a list where read back from spec.yaml
        if isinstance(indices, list):
            object.__setattr__(self, "gpu_indices", tuple(indices))

    @property
    def gpus(self) -> tuple[int, ...]:
        """The physical GPU indices a probe of `ranks` GPUs uses (empty on the CPU)."""
        if self.device != "cuda":
            return ()
        return self.gpu_indices or ((self.gpu_index,) if self.gpu_index is not None else ())

    def describe(self, long: bool = False) -> str:
        """`cuda:0 NVIDIA H200, 40 GiB limit`; `long` adds what memory means on the CPU (for results)."""
        lim = f", {format_size(self.memory_limit_bytes)} limit" if self.memory_limit_bytes else ""
        if self.device == "cpu":
            procs = f", {self.ranks} processes (gloo)" if self.ranks > 1 else ""
            long_form = f"cpu (no GPU: memory is host RSS added by the probe{lim}{procs})"
            return long_form if long else f"cpu{lim}{procs}"
        if self.ranks > 1:
            return f"cuda:{','.join(map(str, self.gpus))} {self.ranks}x {self.gpu_name}{lim} each"
        return f"cuda:{self.gpu_index} {self.gpu_name}{lim}"

    @property
    def usable_bytes(self) -> int | None:
        """The memory a peak may reach: the limit (else the card's memory) less the headroom (None on the
        CPU without a limit)."""
        return usable_bytes(self.memory_limit_bytes or self.card_bytes, self.headroom)


def check_headroom(headroom: float) -> None:
    """--headroom: the share of the limit kept free, at least 0 and under a half (search and plan alike)."""
    if not 0 <= headroom < 0.5:
        raise UsageError(f"--headroom: {headroom} is out of range; expected a fraction from 0 up to (not including) "
                         "0.5, such as 0.05 (5%).")


def resolve_targets(gpu: str | None, device: str | None, memory_limit: str | None,
                    headroom: float = HEADROOM, per_probe: int = 1) -> list[Target]:
    """--gpu / --device / --memory-limit / --gpus -> one Target per worker.

    `per_probe` (--gpus N): each probe spans N GPUs; the --gpu list (default: the first N GPUs) is cut
    into groups of N, one search worker per group. On the CPU: N processes (gloo)."""
    limit = parse_size(memory_limit) if memory_limit is not None else None
    if per_probe < 1:
        raise UsageError(f"--gpus: {per_probe} is not a number of GPUs; expected 1 or more (for example 2).")
    check_headroom(headroom)
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device: {device!r} is not known; expected cpu or cuda.")
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other; give one of them.")
    found = {g.index: g for g in gpus()} if device != "cpu" else {}
    if gpu is None and (device == "cpu" or not found):
        if device == "cuda":
            raise UsageError("--device cuda: no NVIDIA GPU is visible here; use --device cpu.")
        return [Target("cpu", None, "", limit, headroom, ranks=per_probe)]
    try:
        default = ",".join(str(i) for i in sorted(found)[:per_probe]) or "0"
        wanted = [int(x) for x in (gpu or default).split(",") if x.strip() != ""]
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
    if len(wanted) % per_probe:
        problems.append(f"--gpus {per_probe}: the GPUs {','.join(map(str, wanted))} do not split into groups "
                        f"of {per_probe}; give --gpu with a multiple of {per_probe} GPUs (for example "
                        f"{','.join(map(str, range(per_probe)))}).")
    if problems:
        raise UsageError(problems)
    if per_probe == 1:
        return [Target("cuda", i, found[i].name, limit, headroom, card_bytes=found[i].memory_bytes)
                for i in wanted]
    groups = [tuple(wanted[k:k + per_probe]) for k in range(0, len(wanted), per_probe)]
    return [Target("cuda", g[0], found[g[0]].name, limit, headroom, ranks=per_probe, gpu_indices=g,
                   card_bytes=min(found[i].memory_bytes for i in g)) for g in groups]
