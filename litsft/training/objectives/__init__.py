"""Training objectives: what an optimizer step minimizes and what validation reports, one module each.

The engine (litsft.training.step, litsft.training.evaluation) knows an objective only through `Objective`
(base.py): how many units a micro-batch's loss is summed over, and that summed loss from a forward pass. It
divides each rank's sum by the global count of units, so every unit weighs the same whatever the packing,
micro-batch size or number of ranks, runs the backward pass, clips and updates. A recipe names its objective
(`Recipe.objective`); a new objective is a module here and its entry in OBJECTIVES.
"""

from __future__ import annotations

from litsft.errors import LitsftError
from litsft.training.objectives.base import Objective
from litsft.training.objectives.cross_entropy import TokenCrossEntropy

OBJECTIVES: dict[str, type[Objective]] = {TokenCrossEntropy.name: TokenCrossEntropy}


def objective_named(name: str) -> Objective:
    """The objective registered as `name`."""
    if name not in OBJECTIVES:
        raise LitsftError(f"no training objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]()


__all__ = ["OBJECTIVES", "Objective", "TokenCrossEntropy", "objective_named"]
