"""litsft/training/objectives/orpo.py: ORPO (Hong et al. 2024, eqs. 6-8), reference-free: per pair, the chosen reply's
mean cross-entropy plus lambda times minus log sigmoid of the log odds ratio, against the formula written out here
from the replies' probabilities."""

from __future__ import annotations

import pytest
import torch
from tiny_pairs import random_scores

from litsft.errors import LitsftError
from litsft.training.args import ObjectiveConfig
from litsft.training.objectives import objective_named
from litsft.training.objectives.orpo import ORPO


@pytest.mark.parametrize("lam", [None, 0.1, 1.0])
def test_orpo_is_the_chosen_mean_nll_plus_lambda_times_the_odds_ratio_loss(lam: float | None) -> None:
    scores = random_scores(seed=0 if lam is None else int(10 * lam), reference=False, closest=0.05)
    orpo = ORPO() if lam is None else ORPO(beta=lam)
    lam = 0.1 if lam is None else lam
    assert orpo.beta == lam
    losses, chosen_rewards, rejected_rewards = orpo.pair_losses(scores)
    chosen_mean = scores.chosen / scores.chosen_tokens
    rejected_mean = scores.rejected / scores.rejected_tokens
    p_chosen, p_rejected = torch.exp(chosen_mean), torch.exp(rejected_mean)
    odds_ratio = (p_chosen / (1 - p_chosen)) / (p_rejected / (1 - p_rejected))
    expected = -chosen_mean + lam * torch.log(1 + 1 / odds_ratio)  # -log sigmoid(log OR) = log(1 + 1/OR)
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(chosen_rewards, lam * chosen_mean)
    torch.testing.assert_close(rejected_rewards, lam * rejected_mean)
    for reply in (scores.chosen, scores.rejected):
        (grad,) = torch.autograd.grad(losses.sum(), reply, retain_graph=True)
        (expected_grad,) = torch.autograd.grad(expected.sum(), reply, retain_graph=True)
        torch.testing.assert_close(grad, expected_grad)


def test_without_lambda_orpo_is_the_chosen_replys_mean_cross_entropy() -> None:
    scores = random_scores(pairs=8, reference=False, closest=0.05)
    losses, _, _ = ORPO(beta=1e-12).pair_losses(scores)
    torch.testing.assert_close(losses, -(scores.chosen / scores.chosen_tokens), atol=1e-9, rtol=0)


def test_the_odds_ratio_loss_falls_as_the_chosen_reply_gets_likelier() -> None:
    scores = random_scores(pairs=1, reference=False, closest=0.05)
    base = ORPO(beta=1.0).pair_losses(scores)[0] + scores.chosen / scores.chosen_tokens
    scores.chosen = scores.chosen.detach() + 0.1 * scores.chosen_tokens  # 0.1 nats a token likelier
    likelier = ORPO(beta=1.0).pair_losses(scores)[0] + scores.chosen / scores.chosen_tokens
    assert (likelier < base).all()


def test_orpo_is_built_by_name_without_a_reference() -> None:
    orpo = objective_named("orpo", **ObjectiveConfig(name="orpo", beta=0.5).options())
    assert isinstance(orpo, ORPO) and orpo.beta == 0.5
    assert not orpo.needs_reference and orpo.pairs
    with pytest.raises(LitsftError):
        ObjectiveConfig(name="orpo", label_smoothing=0.1)
