"""What every preference objective shares: a micro-batch of preference pairs scored by the model, each of its
sequences' summed log-probability of its reply, paired up chosen with rejected, and the rewards logged.

The data (litsft.data.pairs) puts each pair's chosen sequence right before its rejected one, as two documents
of a packed row or two rows of an unpacked batch, so the model's per-sequence losses (one forward pass, the
(N, V) logits never held: litsft.model.network.loss) come as chosen, rejected, chosen, rejected...; an empty
filler row of a validation batch has sample index -1 and is left out. A subclass is one loss: `pair_losses`
from the pairs' log-probabilities (`PairScores`)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from litsft.training.objectives.base import Objective

if TYPE_CHECKING:
    import torch
    from torch import nn

SEQUENCE_VALUES = ("sequence_samples", "sequence_targets", "reference_logps")
"""What a pair batch carries beside the model's inputs (litsft.data.loader.collate's `sequences`)."""


@dataclass
class PairScores:
    """Log-probabilities of a micro-batch's pairs' replies, each (P,): summed over the reply's tokens, under
    the model trained and (for objectives with a reference) the reference model, and the replies' lengths in
    tokens (for the length-normalized objectives)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    reference_chosen: torch.Tensor | None = None
    reference_rejected: torch.Tensor | None = None


class PreferenceObjective(Objective):
    """The loss of a preference pair, summed over a micro-batch's pairs (the engine divides by the global
    count of pairs). Logged beside it, as means over pairs: the chosen and rejected rewards, the share of
    pairs whose chosen reward is the higher (reward_accuracy), and the mean margin between them."""

    logged: ClassVar[tuple[str, ...]] = (
        "reward_chosen",
        "reward_rejected",
        "reward_accuracy",
        "reward_margin",
    )
    pairs: ClassVar[bool] = True
    default_beta: ClassVar[float] = 0.1

    def __init__(
        self,
        beta: float | None = None,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        reference: str = "precomputed",
    ) -> None:
        self.beta = self.default_beta if beta is None else beta
        self.label_smoothing = label_smoothing
        self.simpo_gamma = simpo_gamma
        self.reference = reference
        """precomputed: the batches carry it (`reference_pass`); live: the model scores it with its LoRA
        adapters switched off (litsft.model.lora.layers.adapters_disabled)."""

    @property
    def reference_pass(self) -> bool:
        return self.needs_reference and self.reference == "precomputed"

    @property
    def extra_forward_passes(self) -> int:
        return int(self.needs_reference and self.reference == "live")

    def units(self, inputs: dict[str, Any]) -> int:
        return inputs["pairs"]

    def scores(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[PairScores, torch.Tensor]:
        """The pairs' scores from one forward pass of `model`, and which pairs are real (P,) bool."""
        reference = None
        if self.needs_reference and self.reference == "live":
            import torch

            from litsft.model.lora.layers import adapters_disabled

            with torch.no_grad(), adapters_disabled(model):
                reference = sequence_logps(model, inputs)
        elif self.needs_reference:
            reference = inputs["reference_logps"]
        logps = sequence_logps(model, inputs)
        tokens = inputs["sequence_targets"].to(logps.dtype)
        scores = PairScores(
            logps[0::2],
            logps[1::2],
            tokens[0::2],
            tokens[1::2],
            None if reference is None else reference[0::2].to(logps.dtype),
            None if reference is None else reference[1::2].to(logps.dtype),
        )
        return scores, inputs["sequence_samples"][0::2] >= 0

    def summed_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        import torch

        scores, real = self.scores(model, inputs)
        losses, chosen_rewards, rejected_rewards = self.pair_losses(scores)
        # A filler pair's loss may be NaN (ORPO's odds of an empty reply): selected away, not multiplied.
        losses = torch.where(real, losses, 0.0)
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        statistics = torch.stack(
            [
                chosen_rewards,
                rejected_rewards,
                (chosen_rewards > rejected_rewards).to(losses.dtype),
                chosen_rewards - rejected_rewards,
            ]
        )
        self.add_sums(torch.where(real, statistics, 0.0).sum(dim=1))
        return losses.sum()

    @abstractmethod
    def pair_losses(self, scores: PairScores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's loss, and its chosen and rejected rewards (what is logged), each (P,)."""


def sequence_logps(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """Each sequence's log-probability of its reply (S,), summed over its target tokens: minus the model's
    per-sequence cross-entropy, from a pair batch's device inputs."""
    model_inputs = {k: v for k, v in inputs.items() if k not in SEQUENCE_VALUES and k != "pairs"}
    logps = -model(**model_inputs, per_sequence=True)
    # A packed micro-batch of filler rows alone (the end of an ordered pass on some rank) has no sequence,
    # but the model, which every rank of a sharded model must run, counts each of its rows as one.
    return logps[: inputs["sequence_samples"].numel()]


def smoothed_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(beta x logits), with label smoothing eps: the preference taken as flipped with probability
    eps (cDPO, https://ericmitchell.ai/cdpo.pdf): (1 - eps) of it plus eps of -log sigmoid(-beta x logits)."""
    import torch.nn.functional as F

    return (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
