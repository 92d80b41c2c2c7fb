"""litsft/training/objectives/cross_entropy.py: SFT's and pretraining's objective counts the target tokens and sums
their cross-entropy, so that a step (the default objective) is the mean over every target token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_training_step import micro_batch, reference_loss_and_grads, setup

from litsft.training.objectives import TokenCrossEntropy
from litsft.training.step import to_device, train_step


def test_the_units_are_the_target_tokens_and_the_loss_their_summed_cross_entropy() -> None:
    _, model, _ = setup()
    batch = micro_batch(2, 16, targets=5, seed=3)
    inputs = to_device(batch, torch.device("cpu"))
    objective = TokenCrossEntropy()
    assert objective.units(inputs) == 2 * 5
    expected = F.cross_entropy(
        model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), reduction="sum"
    )
    assert objective.summed_loss(model, inputs).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("objective", [None, TokenCrossEntropy()])
def test_a_step_is_the_mean_over_every_target_token_by_default(objective: TokenCrossEntropy | None) -> None:
    fabric, model, optimizer = setup()
    batches = [micro_batch(2, 16, targets=2, seed=1), micro_batch(2, 16, targets=12, seed=2)]
    expected_loss, _ = reference_loss_and_grads(model, batches)
    loss, _, units, _ = train_step(fabric, model, optimizer, batches, max_norm=None, objective=objective)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5) and int(units) == 2 * 2 + 2 * 12
