"""Range checks for the numeric knobs of gr2model's config dataclasses.

A config dataclass checks each numeric field in `__post_init__` with `check`,
which raises `FieldRangeError` naming the field. Direct callers get a plain
ValueError; `tasks.common.load_stage_config` reads `.field` because pydantic
reports a dataclass's `__post_init__` error at the dataclass (`retrieve.train`),
not at the field, and params.yaml errors must name the dotted field.
"""

from __future__ import annotations

import math

__all__ = ["FieldRangeError", "check"]


class FieldRangeError(ValueError):
    """A config field outside its valid range; `field` is the field's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def _describe(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> str:
    low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else None
    high = f"{lt})" if lt is not None else f"{le}]" if le is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"> {gt}" if gt is not None else f">= {ge}"
    if high:
        return f"< {lt}" if lt is not None else f"<= {le}"
    return "a finite number"


def check(
    cfg: object,
    name: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    optional: bool = False,
    why: str = "",
) -> None:
    """Raise FieldRangeError unless `cfg.<name>` is a number within the bounds.

    Floats must also be finite: NaN fails no `<`/`>` test, so without this a NaN
    learning rate would pass every bound and only show up as a NaN loss. With
    `optional`, None is allowed (a knob that is off). `why` is appended to the
    message (the reason for a bound that is not obvious).
    """
    value = getattr(cfg, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldRangeError(name, f"must be a number, got {value!r}")
    reason = f" ({why})" if why else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldRangeError(name, f"must be finite, got {value!r}{reason}")
    ok = (
        (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )
    if not ok:
        raise FieldRangeError(name, f"must be {_describe(gt, ge, lt, le)}, got {value!r}{reason}")
