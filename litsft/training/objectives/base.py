"""The contract between the training engine and an objective."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # the package imports no torch (README, Layout): these are its hints only
    import torch
    from torch import nn


class Objective(ABC):
    """What one micro-batch contributes to a step: its loss summed over some units (target tokens, preference
    pairs, ...) and how many units that is. The engine divides every rank's summed loss by the global count of
    units of the step (over its micro-batches and ranks), so the step minimizes the mean over units; validation
    reports the same mean over the held-out batches."""

    name: ClassVar[str]
    """What recipes call it by (`Recipe.objective`)."""

    @abstractmethod
    def units(self, inputs: dict[str, Any]) -> int:
        """The units this micro-batch's loss is summed over, counted without waiting for the device."""

    @abstractmethod
    def summed_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The forward pass of `model` over a micro-batch's device inputs (`litsft.training.step.to_device`):
        the loss summed over its units, a scalar the engine scales and runs backward through."""
