"""What distinguishes one training recipe from another: how its model is built, filled and saved.

A recipe (recipes/) describes itself as a `Recipe`; `litsft.cli.launcher.launch` checks the run, then builds the
recipe and hands it to `litsft.training.engine.fit`, which trains it. No torch here: the recipe modules import this
one to declare their command line, which must not wait for torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from litsft.model.config import Config

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Recipe:
    """What distinguishes one recipe from another."""

    name: str
    build_model: Callable[[Config], nn.Module]
    """Build the model (called on the meta device) with requires_grad set on what is trained."""
    initialize: Callable[[nn.Module], None]
    """Fill the materialized (possibly sharded) model: load a checkpoint or draw fresh weights."""
    save_final: Callable[[nn.Module, Path], None]
    """Write the final model to the given directory (collective: every rank calls it)."""
    checkpoint_frozen: bool = True
    """Whether step checkpoints hold frozen parameters too (LoRA: no, the base is loaded again)."""
    frozen_base: Path | None = None
    """The model folder the frozen parameters left out of step checkpoints are loaded from again (LoRA's
    base); a resume checks that its weights are those the checkpoint was trained over."""
    trainable: Literal["all", "lora"] = "all"
    """What is trained; decides the FLOPs per token behind MFU."""
    lr_scale: Callable[[str], float] | None = None
    """The factor on the learning rate of a trained parameter, by its name (LoRA+: B's ratio); None: 1 for all."""
