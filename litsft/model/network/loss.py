"""The training loss: summed cross-entropy of the output head over the tokens that carry a label (or one sum per
sequence: the negative log-probability of each sequence's targets, which preference objectives compare), computed
a chunk of tokens at a time so that the full (N, V) logits never exist, with chunks sized by memory; and
`output_logits`, what a family does to the head's raw logits, for the loss and the model's `logits` alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from litsft.model.network.sample_dropout import head_rows

LOSS_CHUNK_BYTES = 2**30
"""What one chunk of logits may take (`loss_chunk_tokens`): the head's logits in the compute dtype and their
fp32 companions (`FP32_BYTES_PER_LOGIT`)."""
FP32_BYTES_PER_LOGIT = 12
"""Per logit of a chunk, beyond the logits in the compute dtype: what eager cross-entropy keeps for its backward
(8 bytes: two fp32 copies of the chunk's logits) and the fp32 gradient. Compiled (`compiled=True`) it keeps
only the compute-dtype logits and two fp32 numbers a row (measured with saved-tensor hooks on bf16 logits,
torch 2.13 on CPU), so this bounds both."""


def loss_chunk_tokens(vocab_size: int, dtype: torch.dtype, budget_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Tokens per loss chunk: the largest power of two whose logits (`vocab_size` per token in `dtype`, the
    head's output dtype, and FP32_BYTES_PER_LOGIT more) fit in `budget_bytes`; at least 1. A power of two
    keeps each chunk's head matmul on whole tiles. With 1 GiB: 2048 for a 32k vocabulary in bf16, 512 for
    128k."""
    per_token = vocab_size * (dtype.itemsize + FP32_BYTES_PER_LOGIT)
    fitting = max(1, budget_bytes // per_token)
    return 1 << (fitting.bit_length() - 1)


def logits_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the output head's logits come out in from `hidden`: autocast's under autocast (bf16-mixed
    and 16-mixed on one device), else that of the hidden states (FSDP2's bf16 parameters, 32-true)."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def output_logits(logits: torch.Tensor, scaling: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """The output head's settings applied to its raw logits (..., V): divided by `scaling` (Granite's
    logits_scaling), then capped to c * tanh(logit / c) with c = `softcap` (Gemma 2's final soft-cap). The one
    definition of both, for `Transformer.logits` and the training loss."""
    if scaling != 1.0:
        logits = logits / scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _logits_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    logits = output_logits(logits.float(), scaling, softcap)  # (N, V), in fp32 for the softmax
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _logits_cross_entropy_by_segment(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scaling: float,
    softcap: float | None,
    segments: torch.Tensor,
    num_segments: int,
) -> torch.Tensor:
    """(num_segments,): the cross-entropy of the rows of each segment, summed (a row labelled -100 adds 0)."""
    logits = output_logits(logits.float(), scaling, softcap)
    per_row = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")  # (N,)
    return per_row.new_zeros(num_segments).index_add(0, segments, per_row)


_COMPILED: list[Callable[..., torch.Tensor]] = []


def _compiled_logits_cross_entropy() -> Callable[..., torch.Tensor]:
    """`_logits_cross_entropy` compiled once per process, with dynamic shapes: chunks differ in length (the
    last one, and every batch's loss tokens), and one graph serves them all."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_logits_cross_entropy, dynamic=True))
    return _COMPILED[0]


def _chunk_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    scaling: float,
    softcap: float | None,
    logits_cross_entropy: Callable[..., torch.Tensor],
    token_index: torch.Tensor | None,
    segments: torch.Tensor | None = None,
    num_segments: int = 0,
) -> torch.Tensor:
    with head_rows(token_index):  # an adapted head's dropout draws each row's mask from its token's sample
        logits = head(hidden)
    if segments is not None:
        return _logits_cross_entropy_by_segment(logits, labels, scaling, softcap, segments, num_segments)
    return logits_cross_entropy(logits, labels, scaling, softcap)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    chunk_size: int,
    softcap: float | None = None,
    compiled: bool = False,
    scaling: float = 1.0,
    token_index: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int = 0,
) -> torch.Tensor:
    """Summed cross-entropy of head(hidden (N, C)) against labels (N,), `chunk_size` tokens at a time (the
    model passes `loss_chunk_tokens`), of the logits `output_logits` makes with `scaling` and `softcap`.
    `token_index` (N,): which of the model's input tokens the rows of `hidden` are (None: all of them, in
    order), for LoRA's per-sample dropout on the head (`litsft.model.network.sample_dropout`). With `segments`
    (N,), the segment (sequence) of each row, one sum per segment instead, (`num_segments`,) in fp32: each
    chunk adds its rows' losses into their segments, so no per-row loss outlives its chunk either (these chunks
    run eager, whatever `compiled` says).

    Each chunk's logits are recomputed in the backward pass instead of kept, so the full (N, V) fp32
    logits (2 GiB for one 4k sequence with a 128k vocabulary) never exist. `compiled` runs each chunk's
    cast, output settings and cross-entropy through torch.compile (with the model's blocks: litsft.training.parallel), which
    fuses them and keeps no fp32 copy of the logits for the backward pass (FP32_BYTES_PER_LOGIT).
    """
    logits_cross_entropy = _compiled_logits_cross_entropy() if compiled else _logits_cross_entropy
    if hidden.shape[0] <= chunk_size:
        return _chunk_cross_entropy(
            hidden, head, labels, scaling, softcap, logits_cross_entropy, token_index, segments, num_segments
        )
    if token_index is None:
        token_index = torch.arange(hidden.shape[0], device=hidden.device)
    total = hidden.new_zeros(() if segments is None else (num_segments,), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(
            _chunk_cross_entropy,
            hidden[start:end],
            head,
            labels[start:end],
            scaling,
            softcap,
            logits_cross_entropy,
            token_index[start:end],
            None if segments is None else segments[start:end],
            num_segments,
            use_reentrant=False,
        )
    return total
