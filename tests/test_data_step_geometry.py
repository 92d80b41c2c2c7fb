"""litsft/data/step_geometry.py: the global batch cut into equal shares of whole micro-batches, or refused."""

from __future__ import annotations

import pytest

from litsft.data.step_geometry import StepGeometry
from litsft.errors import LitsftError


@pytest.mark.parametrize(
    ("sizes", "per_rank", "accumulation"), [((32, 4, 2), 16, 4), ((8, 8, 1), 8, 1), ((12, 1, 3), 4, 4)]
)
def test_the_step_geometry_cuts_the_global_batch_into_equal_shares_of_whole_micro_batches(
    sizes, per_rank, accumulation
) -> None:
    geometry = StepGeometry.of(*sizes)
    assert (geometry.samples_per_rank, geometry.accumulation_steps) == (per_rank, accumulation)
    assert (
        geometry.accumulation_steps * geometry.micro_batch_size * geometry.world_size
        == geometry.global_batch_size
    )


def test_a_step_geometry_that_does_not_divide_is_refused_in_one_line() -> None:
    with pytest.raises(LitsftError) as error:
        StepGeometry.of(16, 4, 3)
    assert str(error.value) == (
        "--train.global_batch_size=16 is not divisible by --train.micro_batch_size=4 x 3 processes = 12; pick a "
        "global batch size that is a multiple of 12"
    )
