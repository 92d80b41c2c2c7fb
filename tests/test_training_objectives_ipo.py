"""litsft/training/objectives/ipo.py: IPO's squared loss (Azar et al. 2023, eq. 17) on length-normalized log-ratios
as TRL computes it, against the formula written out here; its rewards are DPO's, from the summed log-ratios."""

from __future__ import annotations

import pytest
import torch
from tiny_pairs import random_scores

from litsft.errors import LitsftError
from litsft.training.args import ObjectiveConfig
from litsft.training.objectives import objective_named
from litsft.training.objectives.ipo import IPO


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_ipo_is_the_squared_distance_of_the_mean_log_ratio_margin_from_one_over_two_beta(beta: float) -> None:
    scores = random_scores(seed=int(10 * beta))
    losses, chosen_rewards, rejected_rewards = IPO(beta).pair_losses(scores)
    chosen_ratio = scores.chosen - scores.reference_chosen
    rejected_ratio = scores.rejected - scores.reference_rejected
    margin = chosen_ratio / scores.chosen_tokens - rejected_ratio / scores.rejected_tokens
    expected = (margin - 1 / (2 * beta)) ** 2
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(chosen_rewards, beta * chosen_ratio)  # summed, not per token
    torch.testing.assert_close(rejected_rewards, beta * rejected_ratio)
    (grad,) = torch.autograd.grad(losses.sum(), scores.chosen)
    torch.testing.assert_close(grad, (2 * (margin - 1 / (2 * beta)) / scores.chosen_tokens).detach())


def test_the_loss_vanishes_where_the_margin_is_one_over_two_beta() -> None:
    scores = random_scores(pairs=5)
    beta = 0.25  # the target margin is 2 nats a token
    with torch.no_grad():
        rejected_ratio = scores.rejected - scores.reference_rejected
        scores.reference_chosen = scores.chosen - scores.chosen_tokens * (
            2.0 + rejected_ratio / scores.rejected_tokens
        )
    losses, _, _ = IPO(beta).pair_losses(scores)
    torch.testing.assert_close(losses, torch.zeros(5, dtype=torch.float64))
    # Twice the margin costs as much as none: the loss pulls to the target, not past it.
    scores.reference_chosen = scores.reference_chosen + 2.0 * scores.chosen_tokens
    low = IPO(beta).pair_losses(scores)[0]
    scores.reference_chosen = scores.reference_chosen - 4.0 * scores.chosen_tokens
    high = IPO(beta).pair_losses(scores)[0]
    torch.testing.assert_close(low, torch.full((5,), 4.0, dtype=torch.float64))
    torch.testing.assert_close(high, low)


def test_ipo_is_built_by_name_and_takes_no_label_smoothing() -> None:
    ipo = objective_named("ipo", beta=0.5)
    assert isinstance(ipo, IPO) and ipo.beta == 0.5 and ipo.needs_reference and ipo.pairs
    assert objective_named("ipo").beta == 0.1
    with pytest.raises(LitsftError) as refused:
        ObjectiveConfig(name="ipo", label_smoothing=0.1)
    assert "label_smoothing is for dpo and simpo, not ipo" in str(refused.value)
