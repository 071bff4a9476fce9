"""Generic argument checks that every layer of the package may use (a leaf module: it
imports nothing of mhsa). Checks specific to attention calls are in validate.py."""

from __future__ import annotations


def int_at_least(name: str, value: int, low: int, hint: str = "") -> int:
    """value, if it is an int (not a bool) >= low; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{hint}, got {value!r}")
    return value
