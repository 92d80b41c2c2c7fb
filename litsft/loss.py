"""The training loss: summed cross-entropy of the output head over the tokens that carry a label, computed a
chunk of tokens at a time so that the full (N, V) logits never exist."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    logits = head(hidden).float()  # (N, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    chunk_size: int = 2048,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of head(hidden (N, C)) against labels (N,), `chunk_size` tokens at a time; with
    `softcap` c the logits are first capped to c * tanh(logit / c) (Gemma 2's final soft-capping).

    Each chunk's logits are recomputed in the backward pass instead of kept, so the full (N, V) fp32
    logits (2 GiB for one 4k sequence with a 128k vocabulary) never exist.
    """
    if hidden.shape[0] <= chunk_size:
        return _chunk_cross_entropy(hidden, head, labels, softcap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(
            _chunk_cross_entropy, hidden[start:end], head, labels[start:end], softcap, use_reentrant=False
        )
    return total
