"""`Lockstep` keeps ranks that make different numbers of forward passes in step: a model whose forward pass
is collective (an all-reduce stands for FSDP2's all-gathers) finishes on every rank, and each rank's forward
count ends equal to the busiest rank's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from launch import on_ranks
from torch import nn

from litsft.inference.lockstep import Lockstep


class CollectiveModel(nn.Module):
    """A forward pass that every rank must make together, like a sharded model's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.calls: list[int] = []  # the number of tokens of each call

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        total = self.weight.detach().clone()
        dist.all_reduce(total)  # hangs unless every rank makes this pass
        self.calls.append(tokens.numel())
        return total


def uneven_work() -> tuple[list[int], float]:
    """Rank r makes r + 1 real passes of 4 tokens each, twice over (two request types), then finishes."""
    model = CollectiveModel()
    lockstep = Lockstep(model)
    outputs = []
    for _ in range(2):
        for _ in range(dist.get_rank() + 1):
            outputs.append(model(torch.zeros(1, 4, dtype=torch.long)).item())
        lockstep.finish()
    lockstep.close()
    model(torch.zeros(1, 2, dtype=torch.long))  # after close: no counting all-reduce before the pass
    return model.calls, sum(outputs)


def test_ranks_with_less_work_take_part_in_the_others_passes(tmp_path: Path) -> None:
    answers = on_ranks(3, uneven_work, tmp_path)
    for rank, (calls, total) in answers.items():
        # Each request type: 3 passes on every rank (the busiest rank's), this rank's real ones first, then
        # one-token passes; then the pass after close.
        real = [4] * (rank + 1)
        assert calls == (real + [1] * (3 - len(real))) * 2 + [2]
        assert total == 3.0 * 2 * (rank + 1)  # the real passes saw all 3 ranks' weights
