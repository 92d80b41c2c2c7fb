"""ORPO (Hong et al., https://arxiv.org/abs/2403.07691, eqs. 6-8): reference-free, the chosen reply's
cross-entropy plus lambda (`--objective.beta`) times an odds-ratio loss. `--objective.name orpo`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from litsft.training.objectives.preference import PairScores, PreferenceObjective

if TYPE_CHECKING:
    import torch


class ORPO(PreferenceObjective):
    """Per pair: -chosen / |chosen| (the chosen reply's mean cross-entropy per token) - lambda x log sigmoid(
    log odds(chosen) - log odds(rejected)), odds(y) = P(y) / (1 - P(y)) with P(y) the reply's mean
    log-probability per token exponentiated; the rewards are lambda x each reply's mean log-probability.
    The cross-entropy is each pair's own mean (the paper's expectation over pairs), where TRL's ORPOTrainer
    takes one mean over the batch's chosen tokens."""

    name: ClassVar[str] = "orpo"

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        chosen = scores.chosen / scores.chosen_tokens.clamp(min=1)
        rejected = scores.rejected / scores.rejected_tokens.clamp(min=1)
        # log(P / (1 - P)) = log P - log(1 - exp(log P)): log1p(-exp(x)) is exact for log P < 0.
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -chosen - self.beta * F.logsigmoid(log_odds)
        return losses, self.beta * chosen, self.beta * rejected
