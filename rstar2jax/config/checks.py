"""What a run-config field's values must be: a :class:`Check` accepts a value or not and says what is allowed,
for the one line a bad value gets (``config.rl.keep=0: must be an integer in [1, ...]``). The constructors
below (:func:`integer`, :func:`number`, :func:`choice`, :func:`flag`, :func:`text`, :func:`optional`,
:func:`url`) are the vocabulary the run-config schema (``rstar2jax.config.schema``) declares its fields in.

Each check also carries ``bad``: values it must refuse (an out-of-range number, an unknown choice; a string
where a number or a flag belongs, as a command line would give it). The config tests set each of them
through the launchers, so a field whose check lets a bad value through fails a test.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Check:
    """``accepts(value)``: whether a value is allowed, said as ``expectation`` ("must be ..."); ``type``: the
    value type (of a placeholder when the default is None); ``bad``: values it must refuse."""

    accepts: Callable[[Any], bool]
    expectation: str
    type: type
    bad: tuple = ()

    def __call__(self, value: Any) -> bool:
        try:
            return bool(self.accepts(value))
        except TypeError:  # a comparison with a value of another type
            return False


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int | None = None, high: int | None = None) -> Check:
    """An int (not a bool) in ``[low, high]`` (either bound may be open-ended)."""
    if low == 1 and high is None:
        expectation = "must be a positive integer"
    elif high is None:
        expectation = "must be an integer" + ("" if low is None else f" >= {low}")
    else:
        expectation = f"must be an integer in [{low}, {high}]"
    bad = [] if low is None else [low - 1] + ([-1] if low > 0 else [])
    bad += [] if high is None else [high + 1]
    return Check(
        lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high),
        expectation,
        int,
        (*bad, "x"),  # "x": a command line's text where a number belongs
    )


def number(low: float | None = None, high: float | None = None, *, open_low: bool = False,
           open_high: bool = False, expectation: str = "") -> Check:
    """A finite number in the interval from ``low`` to ``high`` (``open_low`` / ``open_high``: excluded)."""
    if not expectation:
        if high is None:
            expectation = {(0, True): "must be positive", (0, False): "must be >= 0"}.get(
                (low, open_low), f"must be {'>' if open_low else '>='} {low}")
        else:
            expectation = f"must be in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"

    def accepts(v) -> bool:
        if not is_number(v):
            return False
        above = low is None or (v > low if open_low else v >= low)
        return above and (high is None or (v < high if open_high else v <= high))

    bad = [] if low is None else [low] * open_low + [low - 1]
    bad += [] if high is None else [high if open_high else high + 1]
    return Check(accepts, expectation, float, (*bad, float("inf"), "x"))


def choice(options: Sequence[Any]) -> Check:
    """One of ``options``."""
    options = tuple(options)
    return Check(lambda v: v in options, f"must be one of {options}", type(options[0]), ("no_such_choice",))


def flag() -> Check:
    """True or False."""
    return Check(lambda v: isinstance(v, bool), "must be True or False", bool, ("maybe",))


def text(*, empty: bool = True) -> Check:
    """A string (``empty=False``: a non-empty one)."""
    if empty:
        return Check(lambda v: isinstance(v, str), "must be a string", str)
    return Check(lambda v: isinstance(v, str) and bool(v), "must be a non-empty string", str, ("",))


def url() -> Check:
    """'' or an http(s) URL."""
    return Check(
        lambda v: isinstance(v, str) and (not v or v.startswith(("http://", "https://"))),
        "must be '' or an http:// or https:// URL",
        str,
        ("localhost:8000",),
    )


def optional(check: Check) -> Check:
    """None, or a value ``check`` accepts."""
    return Check(lambda v: v is None or check(v), f"{check.expectation} or None", check.type, check.bad)


POSITIVE = integer(low=1)
AT_LEAST_0 = integer(low=0)


@dataclasses.dataclass(frozen=True)
class Field:
    """One run-config field (``rstar2jax.config.schema``): ``default``, the ``check`` its values must pass,
    its meaning (``help``) and, for a field naming a file, what must exist there when the run starts
    (``exists``: "path", "folder", "data": SFT data, "problems": a problem set when it names a local file;
    data only outside dry runs)."""

    default: Any
    check: Check
    help: str
    exists: str = ""


def choices(meanings: dict[str, str], allowed: tuple[str, ...]) -> str:
    """``a (meaning) / b (meaning)`` over ``allowed`` in its order; ``meanings`` must cover exactly those
    values (a value added to the library without a meaning here fails at import, not silently in the help)."""
    if set(meanings) != set(allowed):
        raise ValueError(f"meanings for {sorted(meanings)}, but the allowed values are {allowed}")
    return " / ".join(f"{value} ({meanings[value]})" for value in allowed)
