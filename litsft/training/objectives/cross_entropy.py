"""Next-token cross-entropy over the target tokens: the objective of SFT (finetune_full, finetune_lora) and of
pretraining."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from litsft.training.objectives.base import Objective

if TYPE_CHECKING:
    import torch
    from torch import nn


class TokenCrossEntropy(Objective):
    """Every target token weighs the same: a step's loss is the cross-entropy summed over its target tokens
    (the labels that carry a loss, `loss_positions`) over their global count. The model computes the sum
    itself, in chunks that never hold the (N, V) logits (litsft.model.network.loss)."""

    name: ClassVar[str] = "cross_entropy"

    def units(self, inputs: dict[str, Any]) -> int:
        return inputs["loss_positions"].numel()

    def summed_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return model(**inputs)
