"""Training objectives: what an optimizer step minimizes and what validation reports, one module each.

The engine (litsft.training.step, litsft.training.evaluation) knows an objective only through `Objective`
(base.py): how many units a micro-batch's loss is summed over, and that summed loss from a forward pass. It
divides each rank's sum by the global count of units, so every unit weighs the same whatever the packing,
micro-batch size or number of ranks, runs the backward pass, clips and updates. A run names its objective
(`--objective.name`); a new objective is a module here and its entry in OBJECTIVES.

Cross-entropy over target tokens trains SFT and pretraining; DPO, IPO, SimPO and ORPO train on preference
pairs (preference.py, what they share, and one module each).
"""

from __future__ import annotations

from typing import Any

from litsft.errors import LitsftError
from litsft.training.objectives.base import Objective
from litsft.training.objectives.cross_entropy import TokenCrossEntropy
from litsft.training.objectives.dpo import DPO
from litsft.training.objectives.ipo import IPO
from litsft.training.objectives.orpo import ORPO
from litsft.training.objectives.simpo import SimPO

OBJECTIVES: dict[str, type[Objective]] = {
    objective.name: objective for objective in (TokenCrossEntropy, DPO, IPO, SimPO, ORPO)
}


def objective_named(name: str, **options: Any) -> Objective:
    """The objective registered as `name`, with its options (a preference objective's beta, ...)."""
    if name not in OBJECTIVES:
        raise LitsftError(f"no training objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**options)


__all__ = ["OBJECTIVES", "Objective", "TokenCrossEntropy", "objective_named"]
