"""litsft/training/objectives/dpo.py: DPO's loss (Rafailov et al. 2023, eq. 7) with cDPO's label smoothing, against
the formula written out here, and its rewards beta x (log-probability - reference log-probability)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_pairs import random_scores

from litsft.errors import LitsftError
from litsft.training.args import ObjectiveConfig
from litsft.training.objectives import objective_named
from litsft.training.objectives.dpo import DPO
from litsft.training.objectives.preference import PairScores


def by_hand(scores: PairScores, beta: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), h the chosen minus the rejected log-ratio."""
    chosen = scores.chosen - scores.reference_chosen
    rejected = scores.rejected - scores.reference_rejected
    h = chosen - rejected
    sigmoid = 1 / (1 + torch.exp(-beta * h))
    losses = -(1 - eps) * torch.log(sigmoid) - eps * torch.log(1 - sigmoid)
    return losses, beta * chosen, beta * rejected


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_is_minus_log_sigmoid_of_beta_times_the_difference_of_log_ratios(
    beta: float, label_smoothing: float
) -> None:
    scores = random_scores(seed=int(10 * beta))
    losses, chosen_rewards, rejected_rewards = DPO(beta, label_smoothing).pair_losses(scores)
    expected = by_hand(scores, beta, label_smoothing)
    for got, want in zip((losses, chosen_rewards, rejected_rewards), expected):
        assert got.shape == (16,)
        torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad(losses.sum(), scores.chosen)
    (expected_grad,) = torch.autograd.grad(expected[0].sum(), scores.chosen)
    torch.testing.assert_close(grad, expected_grad)
    # The gradient of (1 - eps) x -log sigmoid(beta h) + eps x -log sigmoid(-beta h) with h: written out.
    h = (scores.chosen - scores.reference_chosen - scores.rejected + scores.reference_rejected).detach()
    sig = torch.sigmoid(beta * h)
    torch.testing.assert_close(grad, -beta * ((1 - label_smoothing) * (1 - sig) - label_smoothing * sig))


def test_a_pair_as_likely_as_under_the_reference_costs_log_2() -> None:
    scores = random_scores(pairs=4)
    scores.reference_chosen = scores.chosen.detach() + 1.5
    scores.reference_rejected = scores.rejected.detach() + 1.5  # equal ratios: h = 0
    for eps in (0.0, 0.2):
        losses, chosen_rewards, _ = DPO(0.1, eps).pair_losses(scores)
        torch.testing.assert_close(losses, torch.full((4,), math.log(2), dtype=torch.float64))
        torch.testing.assert_close(chosen_rewards, torch.full((4,), -0.15, dtype=torch.float64))


def test_dpo_is_built_by_name_with_its_options() -> None:
    dpo = objective_named("dpo", beta=0.3, label_smoothing=0.2)
    assert isinstance(dpo, DPO) and (dpo.beta, dpo.label_smoothing) == (0.3, 0.2)
    assert dpo.needs_reference and dpo.pairs
    assert dpo.logged == ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")
    default = objective_named("dpo")
    assert (default.beta, default.label_smoothing) == (0.1, 0.0)
    configured = objective_named(
        "dpo", **ObjectiveConfig(name="dpo", beta=0.25, label_smoothing=0.1).options()
    )
    assert (configured.beta, configured.label_smoothing) == (0.25, 0.1)
    for bad in ({"beta": 0.0}, {"label_smoothing": 0.5}):
        with pytest.raises(LitsftError):
            ObjectiveConfig(name="dpo", **bad)
