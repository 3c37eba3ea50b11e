"""What the probe raises for outcomes it decides itself (unsupported, the CPU memory limit)."""

from __future__ import annotations


class Unsupported(Exception):
    """The configuration cannot run on this machine (not the user's mistake)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"autofit: unsupported: {why}")


class MemoryLimitExceeded(Exception):
    """The CPU probe grew past its memory limit."""
