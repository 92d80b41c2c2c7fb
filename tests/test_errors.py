"""litsft/errors.py: the user-error type and `check_number`, the range check every numeric option uses: which
values pass, and the one line that names the option, the bounds and the fix."""

from __future__ import annotations

import math

import pytest

from litsft.errors import LitsftError, check_number


@pytest.mark.parametrize(
    ("value", "bounds"),
    [
        (None, {"at_least": 1}),  # an option left unset
        (1, {"at_least": 1}),
        (0.5, {"above": 0, "below": 1}),
        (1, {"above": 0, "at_most": 1}),
        (-3, {}),
    ],
)
def test_values_within_the_bounds_pass(value, bounds) -> None:
    check_number("--x", value, **bounds)


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (0, {"at_least": 1}, "--train.epochs=0 must be at least 1"),
        (0.0, {"above": 0}, "--train.epochs=0.0 must be greater than 0"),
        (1.5, {"above": 0, "at_most": 1}, "--train.epochs=1.5 must be greater than 0 and at most 1"),
        (1, {"at_least": 0, "below": 1}, "--train.epochs=1 must be at least 0 and less than 1"),
        (2e-5, {"at_least": 1e-4}, "--train.epochs=2e-05 must be at least 0.0001"),
        (math.nan, {"at_least": 0}, "--train.epochs=nan must be at least 0"),
    ],
)
def test_values_outside_the_bounds_name_the_option_and_the_bounds(value, bounds, message) -> None:
    with pytest.raises(LitsftError) as error:
        check_number("--train.epochs", value, **bounds)
    assert str(error.value) == message


def test_the_fix_follows_the_bounds() -> None:
    with pytest.raises(LitsftError) as error:
        check_number("--data.num_workers", -1, at_least=0, fix="0 builds batches in the training process")
    assert (
        str(error.value)
        == "--data.num_workers=-1 must be at least 0; 0 builds batches in the training process"
    )
