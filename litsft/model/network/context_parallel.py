"""Context parallelism (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509): the N ranks of a context group
read the same micro-batch, each holding a contiguous 1/N of its tokens through every layer but attention.
Around attention an all-to-all turns this rank's tokens with all heads into all tokens with 1/N of the heads
(`heads_from_tokens`), any of litsft's attention kernels runs unchanged on whole sequences (documents,
windows, soft-capping), and a second all-to-all turns the result back (`tokens_from_heads`).

The all-to-alls are torch's functional collective `all_to_all_single_autograd`: its backward is the reverse
all-to-all, it works on gloo (the CPU tests) as on NCCL, and torch.compile traces it: `attend` with a context
compiles with fullgraph=True and dynamic=True, so a compiled block keeps its attention in one graph. The eager
`dist.all_to_all_single` has no backward, which would need an autograd.Function of our own.

Host side, `split_for_context` gives each rank its share of a micro-batch: the rows joined into one row of
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


def split_for_context(inputs: dict[str, Any], shard: ContextShard) -> dict[str, Any]:
    """This rank's model inputs for a micro-batch, from the whole one's (what
    litsft.model.network.batch.model_inputs returns), on the host.

    Every layout becomes one row (1, W) of documents: packed rows as model_inputs joined them (or joined here
    when there was no padding to drop), unpacked rows (B, T) each one document of T tokens, which is what
    attention, RoPE and a mixture of experts' per-sequence routing statistics already treat a row as. W is
    the tokens rounded up to a multiple of N by one padding document at the end (labels -100, nothing real
    attends to it): fewer than N tokens per micro-batch, where padding each row would add up to N per row,
    and a padded row's tail would join its row's routing statistics and LongRoPE length.

    Returned: `input_ids`, `labels` (1, W/N) this rank's contiguous slice, `loss_positions` of those labels,
    `position_ids` (1, W) and `documents` whole (attention and RoPE are prepared for the whole row), and
    `context`: `shard`. The labels are already next-token targets aligned with their inputs (the collate
    shifts them, litsft.data.base), so a slice keeps each target with its input: a target whose previous
    token sits on another rank trains all the same, attention having brought that token's keys over."""
    # attention imports this module for `attend`: import its neighbours when called, not at import.
    from litsft.model.network.attention import Documents
    from litsft.model.network.batch import loss_positions_of

    input_ids, labels = inputs["input_ids"], inputs["labels"]
    B, T = input_ids.shape
    position_ids = inputs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(T).expand(B, T)
    documents = inputs.get("documents")
    if documents is None:  # unpacked rows (or an all-padding filler batch): each row one document
        documents = Documents(torch.arange(0, (B + 1) * T, T, dtype=torch.int32), T)
    width = B * T
    padding = -width % shard.size
    if padding:
        cu_seqlens = documents.cu_seqlens
        end = cu_seqlens[-1:] + padding
        documents = Documents(
            torch.cat([cu_seqlens, end.to(cu_seqlens.dtype)]), max(documents.max_seqlen, padding)
        )
    local = shard.local(width + padding)

    def padded(x: torch.Tensor, value: int | None) -> torch.Tensor:
        tail = torch.arange(padding) if value is None else torch.full((padding,), value)
        return torch.cat([x.flatten(), tail.to(x.dtype)])[None]  # (1, W)

    local_labels = padded(labels, -100)[:, local]
    split = {name: value for name, value in inputs.items() if name != "document_ids"}
    split.update(
        input_ids=padded(input_ids, 0)[:, local],
        labels=local_labels,
        loss_positions=loss_positions_of(local_labels),
        position_ids=padded(position_ids, None),
        documents=documents,
        context=shard,
    )
    return split
