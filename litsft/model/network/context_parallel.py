"""Context parallelism (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509): the N ranks of a context group
read the same micro-batch, each holding a contiguous 1/N of its tokens through every layer but attention.
Around attention an all-to-all turns this rank's tokens with all heads into all tokens with 1/N of the heads
(`heads_from_tokens`), any of litsft's attention kernels runs unchanged on whole sequences (documents,
windows, soft-capping), and a second all-to-all turns the result back (`tokens_from_heads`).

The all-to-alls are torch's functional collective `all_to_all_single_autograd`: its backward is the reverse
all-to-all, it works on gloo (the CPU tests) as on NCCL, and torch.compile traces it: `attend` with a context
compiles with fullgraph=True and dynamic=True, so a compiled block keeps its attention in one graph. The eager
`dist.all_to_all_single` has no backward, which would need an autograd.Function of our own.

Host side, `litsft.model.network.batch.split_for_context` gives each rank its share of a micro-batch: the rows joined into one row of
documents, padded to a multiple of N, this rank's slice of the tokens and labels, the positions and documents
whole (attention and RoPE are prepared for the whole row).

Shapes in comments: B batch, T whole length, t = T / N this rank's, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its context group: the group's process group, its rank in it and its size."""

    group: Any
    """The context group's torch ProcessGroup."""
    rank: int
    size: int

    def local(self, width: int) -> slice:
        """This rank's contiguous share of `width` positions (a multiple of `size`)."""
        share = width // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


def _all_to_all(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """x (N, ...) -> (N, ...): piece j goes to rank j, and piece j of the result came from rank j."""
    return all_to_all_single_autograd(x.contiguous(), None, None, shard.group)


def heads_from_tokens(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """This rank's tokens of every head (B, H, t, D) -> every token of this rank's heads (B, H/N, T, D): rank r
    gets heads [r H/N, (r + 1) H/N)."""
    B, H, t, D = x.shape
    N = shard.size
    pieces = x.view(B, N, H // N, t, D).transpose(0, 1)  # (N, B, H/N, t, D): piece j for rank j
    received = _all_to_all(pieces, shard)  # (N, B, H/N, t, D): piece j is rank j's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(B, H // N, N * t, D)


def tokens_from_heads(y: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Every token of this rank's heads (B, T, H/N, D) -> this rank's tokens of every head (B, t, H, D)."""
    B, T, h, D = y.shape
    N = shard.size
    pieces = y.view(B, N, T // N, h, D).transpose(0, 1)  # (N, B, t, H/N, D): piece j, rank j's tokens
    received = _all_to_all(pieces, shard)  # (N, B, t, H/N, D): piece j is rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(B, T // N, N * h, D)


def kv_heads_for_context(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Keys or values (B, K, t, D) with K divisible by N, ready for `heads_from_tokens`: themselves when N
    divides K, else each kv head repeated lcm(K, N) / K times.

    Why: a query head h reads kv head h // (H / K). With M = lcm(K, N) kv heads, each head repeated M / K times,
    h reads repeated head h // (H / M) (M divides H when K and N do), and rank r's query heads
    [r H/N, (r + 1) H/N) read exactly its repeated heads [r M/N, (r + 1) M/N), H/M queries per kv head: the
    kernels' grouped-query attention maps them right without knowing. Splitting K < N heads otherwise leaves
    ranks without one."""
    K = x.shape[1]
    repeats = 1
    while (K * repeats) % shard.size:  # lcm(K, N) / K; math.lcm cannot take compile's symbolic sizes
        repeats += 1
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)
