"""The probe child: the only side of autofit that imports torch (see child.py)."""

from __future__ import annotations

from .build import RandomTokens

__all__ = ["RandomTokens"]
