"""Expert parallelism: the N ranks of an expert group each own E/N of an MoE layer's experts, whole (rank r
experts [r E/N, (r + 1) E/N)), and each rank routes its own tokens as before. After routing, each (token, expert)
assignment goes to the rank that owns its expert (`dispatch`), every rank runs its experts over the rows it
received, and the results go back where they came from (`combine`), to be weighted and summed per token as
one process does. Dropless: the all-to-alls take uneven splits, so no assignment is dropped and there is no
capacity factor.

The rows travel through torch's functional `all_to_all_single_autograd`, whose backward is the reverse
all-to-all (so gradients flow back to the tokens' ranks, and an expert's weight gradient sums every rank's
tokens for it), on gloo as on NCCL. Its split sizes are host ints: each rank first sends every rank its
per-expert counts for that rank's experts, with a plain all-to-all of the (E,) counts.

A rank that receives no row still runs its experts over an empty slice (`GroupedExperts`): the backward of
both all-to-alls and its weights' (zero) gradients must happen on every rank, or the others wait for it.

The routing statistics (load-balancing loss, expert load) are per token, taken before the dispatch: they do
not change.

Shapes in comments: A this rank's (token, expert) assignments, R the rows it receives, C hidden size, E experts,
N the expert group's size, e = E / N this rank's experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place in its expert group: the group's process group, its rank in it and its size."""

    group: Any
    """The expert group's torch ProcessGroup."""
    rank: int
    size: int

    def local(self, num_experts: int) -> slice:
        """The experts this rank owns of `num_experts` (a multiple of `size`)."""
        share = num_experts // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


@dataclass(frozen=True)
class Exchange:
    """What `combine` needs to send the rows `dispatch` received back: the split sizes of both directions and
    the order that grouped the received rows by expert."""

    sent: list[int]
    """Rows this rank sent to each rank of the group."""
    received: list[int]
    """Rows this rank received from each rank of the group."""
    order: torch.Tensor
    """(R,) the received rows in the order of their experts (stable: by source rank within an expert)."""


def dispatch(
    sorted_x: torch.Tensor, counts: torch.Tensor, shard: ExpertShard
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """This rank's assignments sorted by expert (A, C) and each expert's count (E,) -> the rows of this rank's
    experts from every rank of the group, grouped by expert (R, C), each local expert's rows (e,), and the
    `Exchange` that sends results back."""
    N = shard.size
    e = counts.shape[0] // N
    # Piece j of counts (experts [j e, (j + 1) e)) goes to rank j; piece j received is rank j's counts for ours.
    from_each = torch.empty_like(counts)
    dist.all_to_all_single(from_each, counts.contiguous(), group=shard.group)
    from_each = from_each.view(N, e)  # (N, e): rows from rank j for local expert i
    sent = counts.view(N, e).sum(1).tolist()
    received = from_each.sum(1).tolist()
    rows = all_to_all_single_autograd(sorted_x.contiguous(), received, sent, shard.group)  # (R, C)
    # Rows arrive by source rank, each source's by expert: regroup them by expert.
    expert_of_row = torch.arange(e, device=counts.device).repeat(N).repeat_interleave(from_each.flatten())
    order = expert_of_row.argsort(stable=True)
    return rows[order], from_each.sum(0), Exchange(sent, received, order)


def combine(out: torch.Tensor, exchange: Exchange, shard: ExpertShard) -> torch.Tensor:
    """The experts' results for the rows `dispatch` gave (R, C), in its order -> the results for this rank's
    assignments (A, C), in the order they were sent."""
    by_source = torch.empty_like(out).index_copy(0, exchange.order, out)  # back to the order they arrived
    return all_to_all_single_autograd(by_source, exchange.sent, exchange.received, shard.group)


def local_experts(tensor: torch.Tensor) -> torch.Tensor:
    """An expert weight (E, ...) as the experts' rows this rank computes with: the local rows of a DTensor
    sharded over the expert group (after FSDP's all-gather), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_experts(experts: nn.Module, shard: ExpertShard, mesh: DeviceMesh) -> None:
    """Make `experts` (a GroupedExperts, with its adapters) expert-parallel, in place: each of its parameters
    (E, ...) becomes a DTensor sharded along dim 0 over `mesh`, the expert group's 1-D mesh, this rank's experts'
    rows local (on the meta device too, without communication); FSDP2 then shards those over the rest of the
    shard group, and checkpoints and exports see the whole (E, ...) tensors. Parameter names do not change."""
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            rows = param.detach()[shard.local(param.shape[0])].clone()
            local = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
    experts.expert_shard = shard
