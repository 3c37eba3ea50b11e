"""Units people type: sizes (`24GiB`, `512MiB`, `24GB`) and durations (`30m`, `1h30m`, `90s`).

Sizes are binary where the unit says so (`GiB` = 2**30); `GB` means 1e9, as on a datasheet.
A size needs a unit: a bare `24` is refused (it would be 24 bytes, never what was meant).
"""

from __future__ import annotations

import math
import re

from autofit.core.errors import UsageError

_SIZE_UNITS = {
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*(h|m|s)")


def parse_size(text: str, flag: str = "--memory-limit") -> int:
    """`24GiB` -> 25769803776. Raises UsageError naming `flag` on anything else (a bare number too)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m and not unit:
        raise UsageError(f"{flag}: {text!r} has no unit; a bare number would be bytes. Give for example "
                         f"{m.group(1)}GiB (GiB = 2**30 bytes; GB = 1e9 bytes).")
    if not m or unit not in _SIZE_UNITS:
        raise UsageError(
            f"{flag}: cannot read {text!r} as a size; expected a number and a unit such as "
            "24GiB, 40GiB or 512MiB (GiB = 2**30 bytes; GB = 1e9 bytes)."
        )
    number = float(m.group(1))
    if not math.isfinite(number) or number * _SIZE_UNITS[unit] > 2**64:
        raise UsageError(f"{flag}: {text[:40]!r} is larger than any memory; give for example 24GiB.")
    value = int(number * _SIZE_UNITS[unit])
    if value <= 0:
        raise UsageError(f"{flag}: {text!r} is not a positive size; give for example 24GiB.")
    return value


def bare_seconds(text: str) -> bool:
    """A duration written without a unit (`90`): read as seconds."""
    return re.fullmatch(r"[0-9]+(?:\.[0-9]*)?", str(text).strip()) is not None


def parse_duration(text: str, flag: str = "--budget") -> float:
    """`30m` -> 1800.0, `1h30m` -> 5400.0, `90` -> 90.0 (seconds)."""
    s = str(text).strip().lower()
    if s.startswith("-"):
        raise UsageError(f"{flag}: {text!r} is not positive; give a duration such as 30m, 1h30m or 90s.")
    if bare_seconds(s):
        seconds = float(s)
    else:
        parts = _DURATION_RE.findall(s)
        if not parts or _DURATION_RE.sub("", s).strip():
            raise UsageError(
                f"{flag}: cannot read {text!r} as a duration; expected for example 30m, 1h30m or 90s."
            )
        scale = {"h": 3600.0, "m": 60.0, "s": 1.0}
        seconds = sum(float(n) * scale[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{flag}: {text!r} is not a positive duration; give for example 30m.")
    if seconds < 1:  # shown as 0s, it spent itself before the first probe ("Nothing was probed")
        raise UsageError(f"{flag}: {text!r} is under a second, shorter than any probe; give for example 30m (a "
                         "probe takes seconds on a GPU, more on the CPU).")
    return seconds


def format_size(n: float | None) -> str:
    """Bytes as TiB/GiB with one decimal, MiB or KiB whole, bytes below that; '-' when unknown."""
    if n is None:
        return "-"
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}".replace(f".0 {unit}", f" {unit}")
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
