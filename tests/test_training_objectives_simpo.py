"""litsft/training/objectives/simpo.py: SimPO (Meng et al. 2024, eq. 6), reference-free: -log sigmoid of the scaled
mean log-probabilities' difference less the target margin gamma, against the formula written out here."""

from __future__ import annotations

import pytest
import torch
from tiny_pairs import random_scores

from litsft.training.args import ObjectiveConfig
from litsft.training.objectives import objective_named
from litsft.training.objectives.preference import PairScores
from litsft.training.objectives.simpo import SimPO


def by_hand(scores: PairScores, beta: float, gamma: float, eps: float = 0.0) -> torch.Tensor:
    x = beta * scores.chosen / scores.chosen_tokens - beta * scores.rejected / scores.rejected_tokens - gamma
    return -(1 - eps) * torch.log(1 / (1 + torch.exp(-x))) - eps * torch.log(1 / (1 + torch.exp(x)))


@pytest.mark.parametrize(
    ("options", "beta", "gamma", "eps"),
    [
        ({}, 2.0, 0.5, 0.0),
        ({"beta": 2.5, "simpo_gamma": 1.2}, 2.5, 1.2, 0.0),
        ({"label_smoothing": 0.1}, 2.0, 0.5, 0.1),
    ],
    ids=["defaults", "beta-gamma", "smoothed"],
)
def test_simpo_is_minus_log_sigmoid_of_the_scaled_mean_log_probability_margin_less_gamma(
    options: dict, beta: float, gamma: float, eps: float
) -> None:
    scores = random_scores(seed=len(options), reference=False)
    simpo = SimPO(**options)
    assert (simpo.beta, simpo.simpo_gamma, simpo.label_smoothing) == (beta, gamma, eps)
    losses, chosen_rewards, rejected_rewards = simpo.pair_losses(scores)
    expected = by_hand(scores, beta, gamma, eps)
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(chosen_rewards, beta * scores.chosen / scores.chosen_tokens)
    torch.testing.assert_close(rejected_rewards, beta * scores.rejected / scores.rejected_tokens)
    grads = torch.autograd.grad(losses.sum(), scores.chosen)
    expected_grads = torch.autograd.grad(expected.sum(), scores.chosen)
    torch.testing.assert_close(grads, expected_grads)


def test_simpo_ignores_any_reference_and_the_replies_lengths_normalize() -> None:
    scores = random_scores(pairs=6, reference=False)
    losses = SimPO().pair_losses(scores)[0]
    with_reference = PairScores(*vars(scores).values())
    with_reference.reference_chosen = torch.zeros(6, dtype=torch.float64)
    with_reference.reference_rejected = torch.full((6,), -100.0, dtype=torch.float64)
    torch.testing.assert_close(SimPO().pair_losses(with_reference)[0], losses)
    # Twice as long at the same log-probability a token: the same loss.
    doubled = PairScores(
        2 * scores.chosen, 2 * scores.rejected, 2 * scores.chosen_tokens, 2 * scores.rejected_tokens
    )
    torch.testing.assert_close(SimPO().pair_losses(doubled)[0], losses)


def test_simpo_is_built_by_name_without_a_reference() -> None:
    simpo = objective_named("simpo", **ObjectiveConfig(name="simpo", simpo_gamma=0.8).options())
    assert isinstance(simpo, SimPO)
    assert (simpo.beta, simpo.simpo_gamma, simpo.label_smoothing) == (2.0, 0.8, 0.0)
    assert not simpo.needs_reference and simpo.pairs
    assert objective_named("simpo", beta=2.5).beta == 2.5
