"""The caching allocator's settings in a probe: the config's `expandable_segments`, applied and then checked.

torch reads `PYTORCH_CUDA_ALLOC_CONF` (and `PYTORCH_ALLOC_CONF`) once. A CUDA build has read it before a probe
child's request arrives (the child imports torch, transformers and Trainer first, the standby's head start), so
the variable set from the request reached only the processes the child starts, never its own allocator: every GPU
probe recorded up to December 2026 ran the allocator its parent had, whatever the config said (in the committed
results, 178 of the 179 pairs of configs that differ only in `expandable_segments` have byte-identical reserved
peaks, the other 2 MiB apart). A CPU build reads it later, at the first call that needs it, so there the variable
a parent set still held over a config's `false`. The setting is therefore given to torch's own call
(`torch._C._accelerator_setAllocatorSettings`, `torch.cuda.memory._set_allocator_settings` before it existed)
before the device is touched, after what the process inherited, so that the config's value is the last one the
allocator reads.

When training ends the probe checks what ran: the settings the allocator holds and, on a GPU, whether its segments
are expandable (`torch.cuda.memory_snapshot()`). A probe whose allocator is not the config's is an error, as one
whose checkpointing changed is: its figures would belong to another config.
"""

from __future__ import annotations

import os

from autofit.config import recipe
from autofit.protocol.request import ProbeRequest

KEY = "expandable_segments"


def settings_now() -> str:
    """The settings the allocator last parsed ("" where this torch cannot say)."""
    import torch

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return str(get()) if get is not None else ""


def settings_for(expandable: bool, inherited: str) -> str:
    """What the allocator is given: the inherited settings, then the config's expandable_segments (the
    allocator reads the keys in order, so the last one holds)."""
    return ",".join(s for s in (inherited.strip(" ,"), f"{KEY}:{expandable}") if s)


def expandable_in(settings: str) -> bool:
    """The expandable_segments value these settings leave: the last one given, else the default (False)."""
    value = False
    for part in settings.replace(" ", "").split(","):
        key, _, v = part.partition(":")
        if key == KEY:
            value = v == "True"
    return value


def apply(req: ProbeRequest) -> None:
    """The config's process environment (for the processes the probe starts) and its allocator setting (for
    this one), before the device is touched."""
    import torch

    os.environ.update(recipe.process_env(req.config))
    wanted = settings_for(req.config.expandable_segments, settings_now())
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(wanted)
    elif torch.cuda.is_available():  # torch before 2.9; its CPU builds have no CUDA allocator to set
        torch.cuda.memory._set_allocator_settings(wanted)


def verify(req: ProbeRequest) -> dict[str, object]:
    """What the allocator ran with, for the result's `extra`; an error where it is not the config's setting.

    On a GPU the segments say it (expandable ones exist or not: a CUDA graph's private pool keeps plain ones
    beside them); elsewhere the settings the allocator parsed do.
    """
    import torch

    asked = req.config.expandable_segments
    settings = settings_now()
    ran = expandable_in(settings) if settings else asked  # a torch that cannot say: the setter's word
    if req.device == "cuda":
        flags = [bool(s["is_expandable"]) for s in torch.cuda.memory_snapshot() if "is_expandable" in s]
        if flags:
            ran = any(flags)
    if ran != asked:
        raise RuntimeError(f"autofit: the allocator ran with {KEY}={ran}, but the config asks for {asked} "
                           f"(allocator settings {settings!r}): the probe did not measure the config")
    return {"allocator_settings": settings, "expandable_segments_ran": ran}
