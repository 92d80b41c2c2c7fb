"""Direct Preference Optimization (Rafailov et al., https://arxiv.org/abs/2305.18290, eq. 7), with label
smoothing (cDPO): the objective `--objective.name dpo` trains."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from litsft.training.objectives.preference import PairScores, PreferenceObjective, smoothed_sigmoid_loss

if TYPE_CHECKING:
    import torch


class DPO(PreferenceObjective):
    """-log sigmoid(beta x ((chosen - reference chosen) - (rejected - reference rejected))), log-probabilities
    summed over each reply's tokens; the rewards are beta x (log-probability - reference log-probability)."""

    name: ClassVar[str] = "dpo"
    needs_reference: ClassVar[bool] = True

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen_ratio = scores.chosen - scores.reference_chosen
        rejected_ratio = scores.rejected - scores.reference_rejected
        losses = smoothed_sigmoid_loss(chosen_ratio - rejected_ratio, self.beta, self.label_smoothing)
        return losses, self.beta * chosen_ratio, self.beta * rejected_ratio
