"""litsft/model/network/batch.py: what a collated host batch becomes for the model, on a layout written out by hand: packed
rows joined into one row of their real tokens with document ids kept apart across rows, the loader's
`Documents` passed on, the flat indices of the labels that carry a loss, and the lengths attention runs over."""

from __future__ import annotations

import torch

from litsft.model.network.attention import cumulative_lengths
from litsft.model.network.batch import (
    attended_lengths,
    loss_positions_of,
    model_inputs,
    sequence_of_positions,
    without_padding,
)

# Two packed rows of 5 tokens: row 0 holds documents of 2 and 2 tokens then one padding token, row 1 one
# document of 3 tokens then two padding tokens. Token values say where they sit: 10 * row + column.
DOCUMENT_IDS = torch.tensor([[0, 0, 1, 1, -1], [0, 0, 0, -1, -1]])
INPUT_IDS = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
POSITION_IDS = torch.tensor([[0, 1, 0, 1, 0], [0, 1, 2, 0, 0]])
LABELS = torch.tensor([[-100, 2, -100, 4, -100], [11, 12, -100, -100, -100]])


def packed_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": INPUT_IDS,
        "position_ids": POSITION_IDS,
        "document_ids": DOCUMENT_IDS,
        "labels": LABELS,
        "cu_seqlens": cumulative_lengths([2, 2, 3]),
        "max_seqlen": torch.tensor(3),
    }


def test_padding_is_dropped_and_rows_joined_in_order() -> None:
    input_ids, position_ids, document_ids, labels = without_padding(
        INPUT_IDS, POSITION_IDS, DOCUMENT_IDS, LABELS
    )
    assert input_ids.tolist() == [[0, 1, 2, 3, 10, 11, 12]]
    assert position_ids.tolist() == [[0, 1, 0, 1, 0, 1, 2]]
    assert labels.tolist() == [[-100, 2, -100, 4, 11, 12, -100]]
    # Row 1's document 0 is offset by the row length: it stays apart from row 0's document 0.
    assert document_ids.tolist() == [[0, 0, 1, 1, 5, 5, 5]]


def test_positions_count_from_each_rows_start_when_the_batch_has_none() -> None:
    _, position_ids, _, _ = without_padding(INPUT_IDS, None, DOCUMENT_IDS, LABELS)
    assert position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]


def test_a_batch_without_padding_or_only_padding_is_returned_as_it_is() -> None:
    full = torch.zeros(2, 5, dtype=torch.long)
    assert all(
        a is b
        for a, b in zip(without_padding(INPUT_IDS, None, full, LABELS), (INPUT_IDS, None, full, LABELS))
    )
    padding = torch.full((2, 5), -1)
    out = without_padding(INPUT_IDS, POSITION_IDS, padding, LABELS)
    assert all(a is b for a, b in zip(out, (INPUT_IDS, POSITION_IDS, padding, LABELS)))


def test_loss_positions_are_the_flat_indices_of_labelled_tokens() -> None:
    assert loss_positions_of(LABELS).tolist() == [1, 3, 5, 6]
    assert loss_positions_of(torch.full((2, 3), -100)).tolist() == []


def test_model_inputs_of_a_packed_batch() -> None:
    inputs = model_inputs(packed_batch())
    assert set(inputs) == {"input_ids", "position_ids", "labels", "documents", "loss_positions"}
    assert inputs["input_ids"].tolist() == [[0, 1, 2, 3, 10, 11, 12]]
    assert inputs["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1, 2]]
    assert inputs["labels"].tolist() == [[-100, 2, -100, 4, 11, 12, -100]]
    assert inputs["documents"].cu_seqlens.tolist() == [0, 2, 4, 7] and inputs["documents"].max_seqlen == 3
    # Indices into the joined row, not into the padded (2, 5) batch.
    assert inputs["loss_positions"].tolist() == [1, 3, 4, 5]


def test_each_position_belongs_to_its_document_or_its_row() -> None:
    packed = model_inputs(packed_batch())  # documents of 2, 2 and 3 tokens in one row
    segments, count = sequence_of_positions(packed["loss_positions"], packed["documents"], 1, 7)
    assert segments.tolist() == [0, 1, 2, 2] and count == 3
    segments, count = sequence_of_positions(torch.tensor([1, 3, 5, 6]), None, rows=2, width=4)
    assert segments.tolist() == [0, 0, 1, 1] and count == 2


def test_model_inputs_of_an_unpacked_or_all_padding_batch_keep_its_shape() -> None:
    padded = {"input_ids": INPUT_IDS, "labels": LABELS}
    inputs = model_inputs(padded)
    assert set(inputs) == {"input_ids", "labels", "loss_positions"}
    assert inputs["input_ids"] is INPUT_IDS and inputs["loss_positions"].tolist() == [1, 3, 5, 6]
    # A filler batch of padding only (validation evens out ranks with it): no documents, nothing to learn.
    filler = packed_batch() | {
        "document_ids": torch.full((2, 5), -1),
        "labels": torch.full((2, 5), -100),
        "cu_seqlens": cumulative_lengths([]),
        "max_seqlen": torch.tensor(0),
    }
    inputs = model_inputs(filler)
    assert "documents" not in inputs and inputs["document_ids"].shape == (2, 5)
    assert inputs["loss_positions"].tolist() == []


def test_right_padded_rows_bring_their_real_lengths_and_keep_them_per_document_under_context() -> None:
    """Unpacked rows padded to the longest pass the collate's row_lengths as `real_lengths` (the model leaves
    the rest out of its routing statistics); rows without padding pass none. Split for 3 context ranks, the
    rows become documents with those real lengths, and the padding document up to a multiple of 3 has none;
    packed documents hold no padding but that document."""
    from litsft.model.network.batch import split_for_context
    from litsft.model.network.context_parallel import ContextShard

    padded = {"input_ids": INPUT_IDS, "labels": LABELS, "row_lengths": torch.tensor([5, 3])}
    assert model_inputs(padded)["real_lengths"].tolist() == [5, 3]
    assert "real_lengths" not in model_inputs(padded | {"row_lengths": torch.tensor([5, 5])})
    shard = ContextShard(None, 0, 3)
    assert split_for_context(model_inputs(padded), shard)["real_lengths"].tolist() == [5, 3, 0]
    assert split_for_context(model_inputs(packed_batch()), shard)["real_lengths"].tolist() == [2, 2, 3, 0]
    assert "real_lengths" not in split_for_context(model_inputs(packed_batch()), ContextShard(None, 0, 7))


def test_attention_runs_over_each_packed_document_or_each_whole_unpacked_row() -> None:
    assert attended_lengths(packed_batch()).tolist() == [2, 2, 3]
    assert attended_lengths({"input_ids": INPUT_IDS, "labels": LABELS}).tolist() == [5, 5]
