"""Identity Preference Optimization (Azar et al., https://arxiv.org/abs/2310.12036, eq. 17): a squared loss
that pulls each pair's margin to 1 / (2 beta) instead of pushing it without bound. `--objective.name ipo`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from litsft.training.objectives.preference import PairScores, PreferenceObjective

if TYPE_CHECKING:
    import torch


class IPO(PreferenceObjective):
    """((chosen ratio / chosen tokens - rejected ratio / rejected tokens) - 1 / (2 beta))^2, each ratio the
    reply's log-probability minus the reference's, divided by its length as TRL's DPOTrainer does for IPO
    (trl/trainer/dpo_trainer.py, loss_type "ipo"); the rewards are DPO's, from the summed ratios."""

    name: ClassVar[str] = "ipo"
    needs_reference: ClassVar[bool] = True

    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen_ratio = scores.chosen - scores.reference_chosen
        rejected_ratio = scores.rejected - scores.reference_rejected
        margin = chosen_ratio / scores.chosen_tokens.clamp(
            min=1
        ) - rejected_ratio / scores.rejected_tokens.clamp(min=1)
        losses = (margin - 1 / (2 * self.beta)) ** 2
        return losses, self.beta * chosen_ratio, self.beta * rejected_ratio
