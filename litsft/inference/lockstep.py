"""Forward passes in lockstep, for ranks that score different requests on one sharded model.

Under FSDP2 a forward pass is collective: each layer all-gathers its parameters from every rank of the shard
group (and expert parallelism exchanges tokens between ranks). Ranks that evaluate different slices of a
task run different numbers of forward passes: different batch counts, and generation that stops when a
batch's rows end. A rank that finished early would leave the others waiting in an all-gather for ever.

`Lockstep` keeps the counts equal. Before every forward pass each rank says whether it has real work (one
all-reduce of one integer); a rank that has finished its requests calls `finish`, which answers "no work" and
runs a one-token forward pass for every real pass another rank still makes, until no rank has any. Inputs may
differ between ranks (an all-gather of parameters does not depend on them); only the number of passes must
match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Lockstep:
    """Counts `model`'s forward passes on every rank of the default process group; see the module docstring.

    Args:
        model: The (sharded) model whose forward passes must happen on every rank together; its input is
            token ids (B, T).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._finishing = False
        self._hook = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if not self._finishing:
            self._ranks_with_work(1)

    def _ranks_with_work(self, mine: int) -> int:
        count = torch.tensor([mine], device=next(self.model.parameters()).device)
        dist.all_reduce(count)
        return int(count.item())

    @torch.no_grad()
    def finish(self) -> None:
        """Called by a rank with no forward pass left to make: take part in the others' passes until every
        rank has called it. Returns on all ranks together."""
        self._finishing = True
        try:
            idle = torch.zeros(1, 1, dtype=torch.long, device=next(self.model.parameters()).device)
            while self._ranks_with_work(0) > 0:
                self.model(idle)
        finally:
            self._finishing = False

    def close(self) -> None:
        """Stop counting: the model's forward passes are its own again."""
        self._hook.remove()
