"""Argument checks shared by the strategy, the auto-tuner and the balancer.

Each raises ``ValueError`` naming the argument, what is allowed and what was given; numpy's numbers pass,
bools do not (``True`` is not a count or a rate).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any


def is_real(value: Any) -> bool:
    """A finite real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, least: int = 1, note: str = "") -> None:
    """``value`` is an integer (numpy's included), not a bool, at least ``least``; ``note`` adds what else is
    allowed (", or None")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        allowed = "a positive int (1, 2, 3, ...)" if least == 1 else f"an int >= {least}"
        raise ValueError(f"{name} must be {allowed}{note}, got {value!r}.")


def check_real(name: str, value: Any, allowed: str, holds: Callable[[float], bool]) -> None:
    """``value`` is a finite real number for which ``holds`` is true; ``allowed`` says which (">= 0")."""
    if not is_real(value) or not holds(float(value)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}.")


def check_clock(value: Any) -> None:
    """``value`` is a function returning seconds, as ``time.perf_counter`` (the clock tests inject)."""
    if not callable(value):
        raise ValueError(f"clock must be a function returning seconds (as time.perf_counter), got {value!r}.")
