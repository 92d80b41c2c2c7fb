"""litsft/training/objectives (base.py and the registry in __init__.py): the engine minimizes whatever objective it
is given, its summed loss over its global count of units, and names only the objectives it has."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_training_step import micro_batch, reference_loss_and_grads, setup

from litsft.errors import LitsftError
from litsft.training.objectives import OBJECTIVES, Objective, TokenCrossEntropy, objective_named
from litsft.training.step import train_step


class TwiceTheTokens(Objective):
    """Cross-entropy over twice as many units as there are target tokens: half the mean, half the gradients."""

    name = "twice_the_tokens"

    def units(self, inputs: dict[str, Any]) -> int:
        return 2 * inputs["loss_positions"].numel()

    def summed_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return model(**inputs)


def test_a_step_minimizes_the_objective_it_is_given() -> None:
    """The step's loss and gradients are the objective's summed loss over its units, over both micro-batches: an
    objective that counts its units otherwise than the default halves both."""
    fabric, model, optimizer = setup()
    batches = [micro_batch(2, 16, targets=2, seed=1), micro_batch(2, 16, targets=12, seed=2)]
    expected_loss, expected_grads = reference_loss_and_grads(model, batches)
    captured: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: captured.__setitem__(name, captured.get(name, 0) + grad))
    loss, _, units, _ = train_step(
        fabric, model, optimizer, batches, max_norm=None, objective=TwiceTheTokens()
    )
    assert loss.item() == pytest.approx(expected_loss / 2, rel=1e-5)
    assert int(units) == 2 * (2 * 2 + 2 * 12)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(captured[name], grad / 2, rtol=1e-4, atol=1e-6)


def test_objectives_are_named_and_an_unknown_name_is_refused_in_one_line() -> None:
    assert isinstance(objective_named("cross_entropy"), TokenCrossEntropy)
    assert list(OBJECTIVES) == ["cross_entropy", "dpo", "ipo", "simpo", "orpo"]
    with pytest.raises(LitsftError) as refused:
        objective_named("kto")
    assert (
        str(refused.value)
        == "no training objective 'kto'; choose one of cross_entropy, dpo, ipo, simpo, orpo"
    )
