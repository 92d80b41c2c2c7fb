"""Packing, the split across ranks and resumable loaders (litsft/data/loader.py)."""

from __future__ import annotations

import bisect
import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from litsft.data.loader import IGNORE_INDEX, Row, SFTLoader, collate, pack_rows, plan_epoch
from litsft.data.samples import Samples
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer


def random_samples(lengths: list[int], vocab_size: int = 512, seed: int = 0) -> Samples:
    """Samples of the given token counts; the first third of each sample is "prompt" (no target)."""
    rng = np.random.default_rng(seed)
    tokens, targets = [], []
    for n in lengths:
        tokens.append(rng.integers(0, vocab_size, n, dtype=np.int32))
        targets.append(np.arange(n) >= n // 3)
    return Samples.back_to_back(np.concatenate(tokens), np.concatenate(targets), lengths)


def pack(lengths: list[int], order: np.ndarray, capacity: int) -> list[Row]:
    """`pack_rows` as lists of sample indices."""
    plan = pack_rows(np.asarray(lengths), order, capacity)
    return plan.rows(0, len(plan))


def per_token_losses(model: Transformer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view_as(
        batch["labels"]
    )


def test_packed_losses_equal_one_by_one():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama")).eval()
    lengths = [5, 17, 9, 30, 2, 12, 23, 7]
    samples = random_samples(lengths)
    rows = pack([n - 1 for n in lengths], np.arange(len(lengths)), capacity=40)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    packed = collate(samples, rows, seq_length=40, pad_id=0)
    assert packed["input_ids"].shape == (len(rows), 40)
    with torch.no_grad():
        packed_losses = per_token_losses(model, packed)
        for r, row in enumerate(rows):
            cursor = 0
            for i in row:
                alone = collate(samples, [[i]], seq_length=None, pad_id=0)  # one sample, no padding
                n = lengths[i] - 1
                alone_losses = per_token_losses(model, alone)[0]
                torch.testing.assert_close(
                    packed_losses[r, cursor : cursor + n], alone_losses, atol=1e-5, rtol=0
                )
                assert torch.equal(packed["labels"][r, cursor : cursor + n], alone["labels"][0])
                cursor += n
            assert (packed["labels"][r, cursor:] == IGNORE_INDEX).all()
            assert (packed["document_ids"][r, cursor:] == -1).all()


def test_no_attention_across_documents():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama")).eval()
    samples = random_samples([10, 14, 8])
    batch = collate(samples, [[0, 1, 2]], seq_length=32, pad_id=0)
    document_ids = batch["document_ids"][0]
    perturbed = {key: value.clone() for key, value in batch.items()}
    middle = document_ids == 1
    perturbed["input_ids"][0, middle] = (perturbed["input_ids"][0, middle] + 1) % 512
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        changed = model(perturbed["input_ids"], perturbed["position_ids"], perturbed["document_ids"])
    others = (document_ids == 0) | (document_ids == 2)
    assert torch.equal(logits[0, others], changed[0, others])
    assert not torch.allclose(logits[0, middle], changed[0, middle])
    # Positions restart at each document.
    assert batch["position_ids"][0, :9].tolist() == list(range(9))
    assert batch["position_ids"][0, 9:22].tolist() == list(range(13))


def test_labels_are_shifted_targets():
    samples = random_samples([9])
    batch = collate(samples, [[0]], seq_length=None, pad_id=0)
    tokens, targets = samples.tokens, samples.targets
    assert batch["input_ids"][0].tolist() == tokens[:-1].tolist()
    expected = [int(t) if is_target else IGNORE_INDEX for t, is_target in zip(tokens[1:], targets[1:])]
    assert batch["labels"][0].tolist() == expected
    assert "document_ids" not in batch


def test_unpacked_batches_pad_to_their_longest_sample():
    samples = random_samples([5, 9, 30, 31, 6, 8, 29, 7])
    loader = SFTLoader(samples, 64, False, 0, 0, 1, 2, 8, seed=0)
    widths = {batch["input_ids"].shape[1] for batch in loader}
    longest = {int(max(samples.lengths[row].max() for row in rows)) - 1 for rows in loader.micro_batches()}
    assert widths == longest and max(widths) == 30  # not 64


def test_packing_fills_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, 2000).tolist()
    rows = pack(lengths, rng.permutation(2000), capacity=256)
    assert sorted(i for row in rows for i in row) == list(range(2000))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 256
    assert sum(lengths) / (len(rows) * 256) > 0.98


def test_two_ranks_are_disjoint_and_cover_the_epoch():
    samples = random_samples(list(range(3, 67)))  # 64 samples
    for packing in (False, True):
        loaders = [SFTLoader(samples, 66, packing, 0, rank, 2, 2, 8, seed=1) for rank in range(2)]
        seen = [[i for rows in loader.micro_batches() for row in rows for i in row] for loader in loaders]
        assert not set(seen[0]) & set(seen[1])
        kept = {i for batch in loaders[0].global_batches() for row in batch for i in row}
        assert set(seen[0]) | set(seen[1]) == kept
        assert len(seen[0]) + len(seen[1]) == len(kept)
        assert len(loaders[0]) == len(loaders[1])
        if not packing:
            assert kept == set(range(64))  # 64 samples are exactly 8 global batches


def test_global_batches_do_not_depend_on_world_size_or_micro_batch_size():
    samples = random_samples(list(range(3, 50)))
    for packing in (False, True):
        single = SFTLoader(samples, 48, packing, 0, 0, 1, 4, 4, seed=3)
        accumulated = SFTLoader(samples, 48, packing, 0, 0, 1, 2, 4, seed=3)
        ranks = [SFTLoader(samples, 48, packing, 0, rank, 2, 2, 4, seed=3) for rank in range(2)]
        assert len(single) * 2 == len(accumulated) == len(ranks[0]) * 2
        accumulated_batches = list(accumulated)
        rank_batches = [list(loader) for loader in ranks]
        for step, big in enumerate(single):
            halves = accumulated_batches[2 * step : 2 * step + 2]
            by_rank = [batches[step] for batches in rank_batches]
            if packing:  # same width: the rows themselves must match
                for parts in (halves, by_rank):
                    assert torch.equal(torch.cat([part["input_ids"] for part in parts]), big["input_ids"])
            else:  # padded to each micro-batch's longest: compare the samples
                tokens = {tuple(row[row != 0].tolist()) for row in big["input_ids"]}
                for parts in (halves, by_rank):
                    assert {
                        tuple(row[row != 0].tolist()) for part in parts for row in part["input_ids"]
                    } == tokens


def test_epochs_reshuffle_and_seeds_repeat():
    samples = random_samples(list(range(3, 67)))
    loader = SFTLoader(samples, 66, True, 0, 0, 1, 2, 4, seed=5)
    first = [b["input_ids"] for b in loader]
    again = [b["input_ids"] for b in SFTLoader(samples, 66, True, 0, 0, 1, 2, 4, seed=5)]
    loader.set_epoch(1)
    second = [b["input_ids"] for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(first) == len(second)  # same row shapes every epoch
    assert not all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_saved_state_restores_the_next_batch(num_workers):
    samples = random_samples(list(range(3, 34)) * 2)
    loader = SFTLoader(samples, 32, True, 0, 0, 1, 2, 4, seed=7, num_workers=num_workers)
    loader.set_epoch(1)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    expected = next(iterator)
    assert state == {
        "epoch": 1,
        "position": 3,
        "seed": 7,
        "micro_batches_per_global_batch": 2,
        "global_batch_size": 4,
    }
    resumed = SFTLoader(samples, 32, True, 0, 0, 1, 2, 4, seed=7, num_workers=num_workers)
    resumed.load_state_dict(state)
    batches = list(resumed)
    for key in expected:
        assert torch.equal(batches[0][key], expected[key])
    assert len(batches) == len(loader) - 3
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(loader)


def test_state_carries_over_to_another_world_size_at_a_global_batch_boundary():
    samples = random_samples(list(range(3, 34)) * 2)
    one = SFTLoader(samples, 32, True, 0, 0, 1, 2, 4, seed=7)
    iterator = iter(one)
    next(iterator), next(iterator)  # one global batch
    expected_rows = one.micro_batches()[2] + one.micro_batches()[3]
    two = [SFTLoader(samples, 32, True, 0, rank, 2, 2, 4, seed=7) for rank in range(2)]
    for loader in two:
        loader.load_state_dict(one.state_dict())
        assert loader.position == 1
    assert two[0].micro_batches()[1] + two[1].micro_batches()[1] == expected_rows
    next(iterator)
    with pytest.raises(LitsftError, match="middle of a global batch"):
        two[0].load_state_dict(one.state_dict())


def test_batch_sizes_must_divide():
    with pytest.raises(LitsftError) as error:
        SFTLoader(random_samples([5, 6]), 32, True, 0, 0, 2, 2, 6, seed=0)
    assert str(error.value) == (
        "--train.global_batch_size=6 is not divisible by --train.micro_batch_size=2 x 2 processes = 4; pick a "
        "global batch size that is a multiple of 4"
    )


def test_validation_keeps_every_sample_and_equal_counts_per_rank():
    samples = random_samples(list(range(3, 14)))  # 11 samples, unpacked: 11 rows
    loaders = [SFTLoader(samples, 32, False, 0, rank, 2, 2, 4, seed=0, shuffle=False) for rank in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == 3  # 11 rows + 1 empty row = 3 global batches of 4
    seen = [i for loader in loaders for rows in loader.micro_batches() for row in rows for i in row]
    assert sorted(seen) == list(range(11))
    last = list(loaders[1])[-1]
    assert (last["labels"][-1] == IGNORE_INDEX).all()  # the filler row carries no loss


def test_plan_drops_only_the_incomplete_last_global_batch():
    positions = np.full(10, 4)
    plan = plan_epoch(positions, 8, False, 4, seed=0, epoch=0)
    assert plan.rows(0, len(plan)) == [[i] for i in plan.members.tolist()] and len(plan) == 8
    evaluation = plan_epoch(positions, 8, False, 4, seed=0, epoch=0, shuffle=False)
    assert evaluation.rows(0, len(evaluation)) == [[i] for i in range(10)] + [[], []]


def reference_pack(lengths: list[int], order: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing as rows of Python lists and a sorted list of (room, row) tuples: how the
    loader packed before its plan became flat arrays."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for index in order[np.argsort(-np.asarray(lengths)[order], kind="stable")].tolist():
        need = lengths[index]
        slot = bisect.bisect_left(free, (need, -1))
        if slot < len(free):
            room, row = free.pop(slot)
            rows[row].append(index)
        else:
            room, row = capacity, len(rows)
            rows.append([index])
        if room - need > 0:
            bisect.insort(free, (room - need, row))
    return rows


def reference_micro_batches(
    positions: np.ndarray, capacity: int, packing: bool, sizes: tuple[int, int, int], seed: int, epoch: int,
    shuffle: bool, rank: int,
) -> list[list[list[int]]]:  # fmt: skip
    """One rank's micro-batches planned with lists, as the loader did before: every global batch of the
    epoch built, then the rank's slice of each."""
    world_size, micro, global_batch_size = sizes
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(positions)) if shuffle else np.arange(len(positions))
    if packing:
        rows = reference_pack(positions.tolist(), order, capacity)
        if shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
    else:
        chunk = global_batch_size * 32
        rows = []
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            rows.extend([[i] for i in part[np.argsort(-positions[part], kind="stable")].tolist()])
    if shuffle:
        rows = rows[: len(rows) - len(rows) % global_batch_size]
    else:
        rows = rows + [[] for _ in range(-len(rows) % global_batch_size)]
    batches = [rows[i : i + global_batch_size] for i in range(0, len(rows), global_batch_size)]
    if shuffle and not packing:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    share = global_batch_size // world_size
    return [
        batch[rank * share + k * micro : rank * share + (k + 1) * micro]
        for batch in batches
        for k in range(share // micro)
    ]


ORDER_SIZES = ((1, 4, 8), (2, 2, 8), (4, 1, 8), (8, 3, 24))
"""(world_size, micro_batch_size, global_batch_size) of the pinned batch order."""


def pinned_order_samples() -> Samples:
    lengths = np.random.default_rng(11).integers(2, 66, 997)
    lengths[5] = 65  # a sample that fills a row of max_seq_length 64 alone
    return random_samples(lengths.tolist())


def test_the_batch_order_is_what_it_was_before_the_plan_became_arrays():
    """Every rank's micro-batches, packed and not, training and evaluation, three epochs, on 1, 2, 4 and 8
    ranks: their digest recorded from the list-based planner (commit 5c8b485), and each equal to the
    list-based reference above."""
    samples = pinned_order_samples()
    everything = []
    for packing in (True, False):
        for shuffle in (True, False):
            for world_size, micro, global_batch_size in ORDER_SIZES:
                for epoch in (0, 1, 2):
                    for rank in range(world_size):
                        loader = SFTLoader(samples, 64, packing, 0, rank, world_size, micro,
                                           global_batch_size, seed=4, shuffle=shuffle)  # fmt: skip
                        micro_batches = loader.micro_batches(epoch)
                        sizes = (world_size, micro, global_batch_size)
                        assert micro_batches == reference_micro_batches(
                            samples.lengths - 1, 64, packing, sizes, 4, epoch, shuffle, rank
                        )
                        everything.append(
                            [
                                packing,
                                shuffle,
                                world_size,
                                micro,
                                global_batch_size,
                                epoch,
                                rank,
                                micro_batches,
                            ]
                        )
    digest = hashlib.sha256(json.dumps(everything).encode()).hexdigest()
    assert digest == "2cf38f5ec50014414a65f8b67aa61a9d8caecd287277769f8269de685175015e"


def test_a_small_set_is_batched_as_recorded():
    samples = random_samples([9, 3, 17, 12, 5, 30, 8, 2, 21, 14, 6, 11])
    packed = SFTLoader(samples, 32, True, 0, 0, 1, 2, 4, seed=2)
    assert [packed.global_batches(epoch) for epoch in (0, 1)] == [
        [[[4], [11, 0, 6, 10, 1], [2, 9], [8, 3, 7]]],
        [[[4], [5], [11, 0, 6, 10, 1], [2, 9]]],
    ]
    padded = SFTLoader(samples, 32, False, 0, 0, 1, 2, 4, seed=2)
    assert [padded.global_batches(epoch) for epoch in (0, 1)] == [
        [[[10], [4], [1], [7]], [[3], [11], [0], [6]], [[5], [8], [2], [9]]],
        [[[10], [4], [1], [7]], [[5], [8], [2], [9]], [[3], [11], [0], [6]]],
    ]


@pytest.mark.parametrize("seed", range(6))
def test_packed_rows_equal_the_list_based_packing(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 300))
    lengths = rng.integers(0, capacity + 1, int(rng.integers(1, 3000))).tolist()
    order = rng.permutation(len(lengths))
    assert pack(lengths, order, capacity) == reference_pack(lengths, order, capacity)


def test_a_loader_keeps_only_its_ranks_rows():
    samples = pinned_order_samples()
    loaders = [SFTLoader(samples, 64, True, 0, rank, 4, 2, 8, seed=4) for rank in range(4)]
    shares = [loader.share() for loader in loaders]
    whole = loaders[0].plan()
    assert sum(len(share) for share in shares) == len(whole)
    assert sum(len(share.members) for share in shares) == len(whole.members)
    assert all(loader._share[1] is share for loader, share in zip(loaders, shares))  # kept, nothing else
