"""litsft/optimizer.py: the learning-rate schedule by value against its closed form, and AdamW's groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from litsft.args import OptimizerConfig
from litsft.errors import LitsftError
from litsft.optimizer import build_optimizer, learning_rate, warmup_steps

LR, MIN_LR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 110


def cosine(step: int) -> float:
    """Closed form after warmup: min_lr + (lr - min_lr) / 2 * (1 + cos(pi * progress))."""
    progress = min(1.0, (step - WARMUP) / (TOTAL - WARMUP))
    return MIN_LR + (LR - MIN_LR) / 2 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, LR / WARMUP),  # warmup starts one step in, never at zero
        (4, LR * 5 / WARMUP),
        (WARMUP - 1, LR),  # warmup ends at the peak
        (WARMUP, LR),  # decay starts at the peak
        (WARMUP + 25, MIN_LR + (LR - MIN_LR) / 2 * (1 + math.cos(math.pi / 4))),
        (60, (LR + MIN_LR) / 2),  # halfway through the decay
        (TOTAL, MIN_LR),  # the end of the run
        (TOTAL + 50, MIN_LR),  # past the end: the floor, never below it
    ],
)
def test_cosine_schedule_by_value(step: int, expected: float) -> None:
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, schedule="cosine")
    assert learning_rate(config, step, TOTAL) == pytest.approx(expected, rel=1e-12)
    if step >= WARMUP:
        assert learning_rate(config, step, TOTAL) == pytest.approx(cosine(step), rel=1e-12)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, LR / WARMUP),
        (WARMUP, LR),
        (35, LR - (LR - MIN_LR) / 4),
        (60, (LR + MIN_LR) / 2),
        (TOTAL, MIN_LR),
        (500, MIN_LR),
    ],
)
def test_linear_schedule_by_value(step: int, expected: float) -> None:
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, schedule="linear")
    assert learning_rate(config, step, TOTAL) == pytest.approx(expected, rel=1e-12)


def test_constant_schedule_holds_the_peak_after_warmup() -> None:
    config = OptimizerConfig(lr=LR, warmup_steps=WARMUP, schedule="constant")
    assert [learning_rate(config, s, TOTAL) for s in (0, WARMUP - 1, WARMUP, TOTAL)] == pytest.approx(
        [LR / WARMUP, LR, LR, LR]
    )


def test_the_schedule_never_leaves_the_range_between_min_lr_and_lr() -> None:
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP)
    rates = [learning_rate(config, step, TOTAL) for step in range(TOTAL + 5)]
    after_warmup = rates[WARMUP:]
    assert all(MIN_LR <= rate <= LR for rate in after_warmup)
    assert after_warmup == sorted(after_warmup, reverse=True)  # decays monotonically
    assert rates[:WARMUP] == sorted(rates[:WARMUP])  # rises monotonically


def test_warmup_as_a_fraction_of_all_steps_and_no_warmup() -> None:
    assert warmup_steps(OptimizerConfig(warmup_fraction=0.03), 1000) == 30
    assert warmup_steps(OptimizerConfig(warmup_fraction=0.5, warmup_steps=7), 1000) == 7  # steps win
    no_warmup = OptimizerConfig(lr=LR, min_lr=0.0)
    assert learning_rate(no_warmup, 0, 100) == pytest.approx(LR)
    assert learning_rate(no_warmup, 50, 100) == pytest.approx(LR / 2)


def test_weight_decay_applies_to_matrices_only_and_frozen_parameters_are_left_out() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    model[0].weight.requires_grad_(False)
    optimizer = build_optimizer(model, OptimizerConfig(lr=LR, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6))
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert sorted(p.numel() for p in no_decay["params"]) == [4, 4, 4]  # linear bias, norm weight and bias
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert (decay["lr"], decay["betas"], decay["eps"], decay["fused"]) == (LR, (0.8, 0.9), 1e-6, True)


def test_a_model_with_nothing_to_train_is_refused() -> None:
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(LitsftError, match="no trainable parameters"):
        build_optimizer(model, OptimizerConfig())
