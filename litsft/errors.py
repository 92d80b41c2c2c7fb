"""The one exception type for mistakes a user can fix, and the range check every numeric option uses."""

from __future__ import annotations


class LitsftError(Exception):
    """A user error: bad config, bad data, bad checkpoint. The CLI prints its message on one line and
    exits non-zero without a traceback, so the message must name the bad value and the fix."""


def check_number(
    option: str,
    value: float | None,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    fix: str = "",
) -> None:
    """Raise a LitsftError naming `option` when `value` is outside the given bounds (None, for an option
    left unset, always passes; NaN never does)."""
    if value is None:
        return
    bounds = [
        (at_least, "at least", lambda bound: value >= bound),
        (above, "greater than", lambda bound: value > bound),
        (at_most, "at most", lambda bound: value <= bound),
        (below, "less than", lambda bound: value < bound),
    ]
    if all(holds(bound) for bound, _, holds in bounds if bound is not None):
        return
    wanted = " and ".join(f"{words} {bound:g}" for bound, words, _ in bounds if bound is not None)
    raise LitsftError(f"{option}={value} must be {wanted}" + (f"; {fix}" if fix else ""))
