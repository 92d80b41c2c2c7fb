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
    reports the same mean over the held-out batches. An objective may also sum, over the same units, the
    statistics it logs beside its loss (`logged`), which the engine turns into means the same way."""

    name: ClassVar[str]
    """What recipes call it by (`--objective.name`)."""
    logged: ClassVar[tuple[str, ...]] = ()
    """The per-unit means logged beside the loss, in training and validation (metrics.csv column names; the
    validation ones prefixed with val_)."""
    needs_reference: ClassVar[bool] = False
    """Whether batches must carry the reference model's log-probability of each sequence
    (`reference_logps`, litsft.training.reference)."""
    pairs: ClassVar[bool] = False
    """Whether it trains on preference pairs (the data module deals them whole)."""

    @property
    def extra_forward_passes(self) -> int:
        """No-grad forward passes each micro-batch gets besides its training pass (counted in MFU)."""
        return 0

    @property
    def reference_pass(self) -> bool:
        """Whether the reference log-probabilities are scored in one pass before training
        (litsft.training.reference) and carried by the batches."""
        return False

    @abstractmethod
    def units(self, inputs: dict[str, Any]) -> int:
        """The units this micro-batch's loss is summed over, counted without waiting for the device."""

    @abstractmethod
    def summed_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The forward pass of `model` over a micro-batch's device inputs (`litsft.training.step.to_device`):
        the loss summed over its units, a scalar the engine scales and runs backward through. Adds the sums
        of its `logged` statistics to those `take_sums` returns."""

    def add_sums(self, sums: torch.Tensor) -> None:
        """Add one micro-batch's sums of the `logged` statistics (detached, on the device)."""
        previous = self.__dict__.get("_sums")
        self._sums = sums if previous is None else previous + sums

    def take_sums(self) -> torch.Tensor | None:
        """The `logged` statistics summed since the last call, (len(logged),) on the device; None if none."""
        sums, self._sums = self.__dict__.get("_sums"), None
        return sums
