"""Batches of tokenized samples for training: packing, length grouping, the split across ranks, and a
loader whose position can be saved and restored.

The order of rows is decided once per epoch for the whole job, from (seed, epoch) alone: it is cut into
global batches of `global_batch_size` rows, and rank r takes its share of each global batch as
micro-batches. The global batches therefore do not depend on the world size or the micro-batch size,
which is what lets 1 process x 2 accumulation steps and 2 processes x 1 step train identically.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from litsft.data.samples import Samples
from litsft.errors import LitsftError
from litsft.model.attention import cumulative_lengths

IGNORE_INDEX = -100
PAD_DOCUMENT_ID = -1
LENGTH_GROUPING_FACTOR = 32
"""Without packing, samples are sorted by length within shuffled chunks of this many global batches:
similar lengths share a batch (little padding) while the order stays random across chunks."""

Row = list[int]
"""Indices of the samples that share one row of a batch (one sample without packing)."""


def pack(lengths: list[int], order: np.ndarray, capacity: int) -> list[Row]:
    """Best-fit decreasing: longest sample first, each into the fullest row it still fits in.

    Samples of equal length are taken in `order`, so a new order gives new rows of the same shapes
    (the row count does not change between epochs).
    """
    by_length = order[np.argsort(-np.asarray(lengths)[order], kind="stable")].tolist()
    rows: list[Row] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted: the first fit is the best fit
    for index in by_length:
        need = lengths[index]
        slot = bisect_left(free, (need, -1))
        if slot < len(free):
            room, row = free.pop(slot)
            rows[row].append(index)
        else:
            room, row = capacity, len(rows)
            rows.append([index])
        if room - need > 0:
            insort(free, (room - need, row))
    return rows


def plan_epoch(
    positions: np.ndarray,
    capacity: int,
    packing: bool,
    global_batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[list[Row]]:
    """The global batches of one epoch: lists of `global_batch_size` rows, the incomplete last one
    dropped when shuffling (training) and filled with empty rows otherwise (evaluation)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(positions)) if shuffle else np.arange(len(positions))
    if packing:
        rows = pack(positions.tolist(), order, capacity)
        if shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
    else:
        chunk = global_batch_size * LENGTH_GROUPING_FACTOR
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
    return batches


def collate(
    samples: Samples, rows: list[Row], seq_length: int | None, pad_id: int
) -> dict[str, torch.Tensor]:
    """One micro-batch. A sample of n tokens fills n - 1 positions: its tokens but the last as inputs,
    its tokens but the first as labels (already shifted), -100 where a token is not a target.

    seq_length: packed rows of this length, with `document_ids` and the documents' boundaries in the
        batch's real tokens, rows joined in order (`cu_seqlens`, int32 (D + 1,), and `max_seqlen`, the
        longest document): the attention kernels read them from here, so the training step never waits
        for the device to find them. Row-end padding is in no document: it is dropped before the model.
        None: rows as long as the longest, right-padded.

    Every batch has `row_lengths` (B,): the real tokens at the start of each row, the rest being padding
    (what tokens/s counts, and where each sample's LoRA dropout masks go).
    """
    starts, lengths, tokens, targets = samples.starts, samples.lengths, samples.tokens, samples.targets
    used = [sum(int(lengths[i]) - 1 for i in row) for row in rows]
    length = seq_length if seq_length is not None else max([1, *used])
    input_ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((len(rows), length), dtype=np.int64)
    document_ids = np.full((len(rows), length), PAD_DOCUMENT_ID, dtype=np.int64)
    document_lengths = []
    for b, row in enumerate(rows):
        cursor = 0
        for document, i in enumerate(row):
            start = int(starts[i])
            end = start + int(lengths[i])
            n = end - start - 1
            span = slice(cursor, cursor + n)
            input_ids[b, span] = tokens[start : end - 1]
            labels[b, span] = np.where(targets[start + 1 : end], tokens[start + 1 : end], IGNORE_INDEX)
            position_ids[b, span] = np.arange(n)
            document_ids[b, span] = document
            if n > 0:
                document_lengths.append(n)
            cursor += n
        if seq_length is None:  # right padding continues the positions; it is never attended to
            position_ids[b, cursor:] = np.arange(cursor, length)
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "row_lengths": torch.tensor(used, dtype=torch.int64).reshape(len(rows)),
    }
    if seq_length is not None:
        batch["document_ids"] = torch.from_numpy(document_ids)
        batch["cu_seqlens"] = cumulative_lengths(document_lengths)
        batch["max_seqlen"] = torch.tensor(max([0, *document_lengths]))
    return batch


class _MicroBatches(Dataset):
    """Micro-batch k of one rank's epoch, built on demand (in a worker process when there are any)."""

    def __init__(self, samples: Samples, micro_batches: list[list[Row]], seq_length: int | None, pad_id: int):
        self.samples, self.micro_batches, self.seq_length, self.pad_id = (
            samples,
            micro_batches,
            seq_length,
            pad_id,
        )

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return collate(self.samples, self.micro_batches[index], self.seq_length, self.pad_id)


class SFTLoader:
    """One rank's micro-batches, one epoch per iteration, resumable mid-epoch.

    `for batch in loader` yields the rest of epoch `loader.epoch`; call `set_epoch(epoch + 1)` for the
    next. `state_dict()` records how many micro-batches were handed out, so after `load_state_dict` the
    next batch is the first one the saved run had not seen.
    """

    def __init__(
        self,
        samples: Samples,
        max_seq_length: int,
        packing: bool,
        pad_id: int,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % (world_size * micro_batch_size):
            raise LitsftError(
                f"global_batch_size={global_batch_size} is not a multiple of world_size x micro_batch_size="
                f"{world_size} x {micro_batch_size}; choose sizes so that it is"
            )
        self.samples = samples
        self.positions = samples.lengths - 1
        if len(samples) and self.positions.max() > max_seq_length:
            raise ValueError(
                f"samples must be truncated to max_seq_length + 1 = {max_seq_length + 1} tokens first"
            )
        self.max_seq_length = max_seq_length
        self.packing = packing
        self.pad_id = pad_id
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        """Micro-batches of the current epoch already handed out."""
        self._plan: tuple[int, list[list[Row]]] | None = None

    @property
    def micro_batches_per_global_batch(self) -> int:
        return self.global_batch_size // (self.world_size * self.micro_batch_size)

    def global_batches(self, epoch: int | None = None) -> list[list[Row]]:
        """The epoch's global batches (the same on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if self._plan is None or self._plan[0] != epoch:
            batches = plan_epoch(
                self.positions,
                self.max_seq_length,
                self.packing,
                self.global_batch_size,
                self.seed,
                epoch,
                self.shuffle,
            )
            self._plan = (epoch, batches)
        return self._plan[1]

    def micro_batches(self, epoch: int | None = None, rank: int | None = None) -> list[list[Row]]:
        """This rank's micro-batches of the epoch, as rows of sample indices."""
        rank = self.rank if rank is None else rank
        share = self.global_batch_size // self.world_size
        micro = self.micro_batch_size
        return [
            batch[rank * share + k * micro : rank * share + (k + 1) * micro]
            for batch in self.global_batches(epoch)
            for k in range(share // micro)
        ]

    def __len__(self) -> int:
        return len(self.global_batches()) * self.micro_batches_per_global_batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        micro_batches = self.micro_batches()
        dataset = _MicroBatches(
            self.samples, micro_batches, self.max_seq_length if self.packing else None, self.pad_id
        )
        start = self.position
        if self.num_workers == 0:
            batches: Any = (dataset[i] for i in range(start, len(dataset)))
        else:
            batches = DataLoader(
                dataset, batch_size=None, sampler=range(start, len(dataset)), num_workers=self.num_workers
            )
        for index, batch in enumerate(batches, start=start):
            # Counted before the yield: a checkpoint taken while this batch is in use resumes after it.
            self.position = index + 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "micro_batches_per_global_batch": self.micro_batches_per_global_batch,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["global_batch_size"] != self.global_batch_size:
            raise LitsftError(
                f"the checkpoint's data order has seed={state['seed']}, global_batch_size="
                f"{state['global_batch_size']}, this run seed={self.seed}, global_batch_size="
                f"{self.global_batch_size}; resume with the checkpoint's values"
            )
        position, per_global = state["position"], state["micro_batches_per_global_batch"]
        if per_global != self.micro_batches_per_global_batch:
            # Another world size or micro-batch size: the same global batches, cut differently. Only a
            # position on a global-batch boundary (where optimizer steps save checkpoints) carries over.
            if position % per_global:
                raise LitsftError(
                    f"the checkpoint was saved in the middle of a global batch (micro-batch {position}) and "
                    "this run splits global batches differently; resume with the same devices and micro_batch_size"
                )
            position = position // per_global * self.micro_batches_per_global_batch
        self.epoch, self.position = state["epoch"], position
