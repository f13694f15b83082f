"""Up-front checks of the agents' config knobs: a value of the wrong type or out of its range
is a :class:`~trio_pd.ConfigurationError` naming the field and the value when the agent
opens, never a TypeError or ValueError from deep inside later (a thread, a compare)."""

from __future__ import annotations

import math
from collections.abc import Collection

from ._errors import ConfigurationError


def check_count(what: str, name: str, value: object, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``."""
    if type(value) is not int or value < minimum:
        raise ConfigurationError(f"{what}: {name} must be an int >= {minimum}, not {value!r}")


def check_seconds(
    what: str, name: str, value: object, *, positive: bool = False, optional: bool = False
) -> None:
    """``value`` is a number of seconds (int or float, not a bool, not NaN), >= 0, or > 0
    when ``positive``; None too when ``optional``. Infinity is a deadline that never passes."""
    if value is None and optional:
        return
    ok = (
        type(value) in (int, float)
        and not math.isnan(value)  # type: ignore[arg-type]
        and (value > 0 if positive else value >= 0)  # type: ignore[operator]
    )
    if not ok:
        bound = "seconds > 0" if positive else "seconds >= 0"
        also = " or None" if optional else ""
        raise ConfigurationError(
            f"{what}: {name} must be {bound} (an int or a float){also}, not {value!r}"
        )


def check_choice(what: str, name: str, value: object, choices: Collection[str]) -> None:
    """``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        listed = " or ".join(repr(c) for c in choices)
        raise ConfigurationError(f"{what}: {name} must be {listed}, not {value!r}")
