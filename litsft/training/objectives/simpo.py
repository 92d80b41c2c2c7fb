"""SimPO (Meng et al., https://arxiv.org/abs/2405.14734, eq. 6): reference-free, each reply scored by its
mean log-probability per token, with a target margin gamma. `--objective.name simpo`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from litsft.training.objectives.preference import PairScores, PreferenceObjective, smoothed_sigmoid_loss

if TYPE_CHECKING:
    import torch


class SimPO(PreferenceObjective):
    """-log sigmoid(beta x chosen / |chosen| - beta x rejected / |rejected| - gamma) (`--objective.simpo_gamma`),
    with label smoothing as DPO's; the rewards are beta x each reply's mean log-probability per token. The
    paper's beta is 2 to 2.5 (its Table 7): the default here is 2."""

    name: ClassVar[str] = "simpo"
    default_beta: ClassVar[float] = 2.0

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen = scores.chosen / scores.chosen_tokens.clamp(min=1)
        rejected = scores.rejected / scores.rejected_tokens.clamp(min=1)
        logits = chosen - rejected - self.simpo_gamma / self.beta
        losses = smoothed_sigmoid_loss(logits, self.beta, self.label_smoothing)
        return losses, self.beta * chosen, self.beta * rejected
