"""Host-side batch preparation: a collated batch from the data loader turned into the model's keyword
arguments (packed rows joined into one row of their real tokens, their `Documents`, the positions that carry
a loss), on the host, so that the device never reports boundaries back."""

from __future__ import annotations

from typing import Any

import torch

from litsft.model.network.attention import Documents, document_of_positions
from litsft.model.network.context_parallel import ContextShard


def without_padding(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A packed batch (B, T) as one row (1, N) of its N real tokens, dropping the padding (document id -1)
    that fills the ends of rows, so that no layer computes it. Document ids are made unique across rows,
    so that the last document of one row and the first of the next stay apart. Reads the ids on the host
    (a sync on a GPU: the engine does this on the host before moving the batch, `model_inputs`)."""
    B, T = document_ids.shape
    real = (document_ids >= 0).flatten()
    if bool(real.all()) or not bool(real.any()):  # nothing to drop, or an all-padding filler batch
        return input_ids, position_ids, document_ids, labels
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    document_ids = document_ids + T * torch.arange(B, device=document_ids.device)[:, None]
    return tuple(x.flatten()[real][None] for x in (input_ids, position_ids, document_ids, labels))


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model's keyword arguments for a collated host batch: packed rows joined into one row of their
    real tokens with the loader's `Documents` (so the device never reports boundaries back to the host),
    right-padded rows with their `real_lengths` (the collate's `row_lengths`, B ints, from which the model
    finds its padding tokens on the device), and the flat indices of the labels that carry a loss
    (`loss_positions_of`)."""
    names = ("input_ids", "position_ids", "document_ids", "labels")
    inputs: dict[str, Any] = {name: batch[name] for name in names if name in batch}
    if "cu_seqlens" in batch and int(batch["cu_seqlens"][-1]) > 0:
        input_ids, position_ids, _, labels = without_padding(
            inputs["input_ids"], inputs.get("position_ids"), inputs.pop("document_ids"), inputs["labels"]
        )
        inputs.update(input_ids=input_ids, position_ids=position_ids, labels=labels)
        inputs["documents"] = Documents(batch["cu_seqlens"], int(batch["max_seqlen"]))
    elif (
        "cu_seqlens" not in batch
        and "row_lengths" in batch
        and bool((batch["row_lengths"] < inputs["input_ids"].shape[1]).any())
    ):
        inputs["real_lengths"] = batch["row_lengths"]  # right-padded rows: the padding is left unrouted
    inputs["loss_positions"] = loss_positions_of(inputs["labels"])
    if "sequence_samples" in batch:  # a preference objective's per-sequence values, and its count of pairs
        inputs.update({name: value for name, value in batch.items() if name in SEQUENCE_VALUES})
        inputs["pairs"] = int((batch["sequence_samples"] >= 0).sum()) // 2
    return inputs


SEQUENCE_VALUES = ("sequence_samples", "sequence_targets", "reference_logps")
"""The per-sequence values a collated batch may carry (litsft.data.loader.collate's `sequences`), passed to
the objective beside the model's inputs."""


def loss_positions_of(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the labels (B, T) that carry a loss (are not -100)."""
    return (labels.flatten() != -100).nonzero().flatten()


def sequence_of_positions(
    positions: torch.Tensor, documents: Documents | None, rows: int, width: int
) -> tuple[torch.Tensor, int]:
    """The sequence of each flat position (N,) of a batch and the number of sequences: with `documents`, the
    one row of packed documents they describe, each document a sequence; else `rows` rows of `width`
    positions, each row one. Found on the device, counted from shapes: nothing waits for it."""
    if documents is not None:
        return document_of_positions(documents, positions), documents.cu_seqlens.numel() - 1
    return positions // width, rows


def attended_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The lengths of the sequences attention runs over in a collated host batch, as a 1-D tensor found
    without reading one: each packed document (`cu_seqlens`), or each row whole when rows are not packed
    (a causal row is attended over its full, padded length)."""
    if "cu_seqlens" in batch:
        return torch.diff(batch["cu_seqlens"].long())
    rows, length = batch["input_ids"].shape
    return torch.full((rows,), length)


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
    `position_ids` (1, W) and `documents` whole (attention and RoPE are prepared for the whole row),
    `real_lengths` of each document when some hold padding (a padded row's tail, the padding document), which
    a mixture of experts leaves out of its routing statistics, and `context`: `shard`. The labels are already next-token targets aligned with their inputs (the collate
    shifts them, litsft.data.base), so a slice keeps each target with its input: a target whose previous
    token sits on another rank trains all the same, attention having brought that token's keys over."""
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
    real_lengths = inputs.get("real_lengths")  # each row's, which is now each document's
    if padding:
        if real_lengths is None:
            real_lengths = torch.diff(documents.cu_seqlens.long())
        real_lengths = torch.cat([real_lengths, real_lengths.new_zeros(1)])  # the padding document: none
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
    if real_lengths is not None:
        split["real_lengths"] = real_lengths
    return split
