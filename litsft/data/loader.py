"""Batches of tokenized samples for training: packing, length grouping, the split across ranks, and a
loader whose position can be saved and restored.

The order of rows is decided once per epoch for the whole job, from (seed, epoch) alone: it is cut into
global batches of `global_batch_size` rows, and rank r takes its share of each global batch as
micro-batches. The global batches therefore do not depend on the world size or the micro-batch size,
which is what lets 1 process x 2 accumulation steps and 2 processes x 1 step train identically.

Every rank plans the whole epoch and keeps only its own rows (`RowPlan`: two flat arrays, no Python object
per sample), so what a rank holds between epochs is 1 / world_size of the plan: about 1 byte a sample on
8 ranks, where the epoch's global batches as lists of lists of Python ints were about 60 (114 MB for
1.9M samples).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from litsft.data.samples import Samples
from litsft.data.step_geometry import StepGeometry
from litsft.errors import LitsftError
from litsft.model.network.attention import cumulative_lengths
from litsft.runtime.heap import release_freed_heap

IGNORE_INDEX = -100
PAD_DOCUMENT_ID = -1
LENGTH_GROUPING_FACTOR = 32
"""Without packing, samples are sorted by length within shuffled chunks of this many global batches:
similar lengths share a batch (little padding) while the order stays random across chunks."""
PACKED_BLOCK = 1 << 16
"""Samples whose lengths `pack_rows` turns into Python ints at a time (not one int per sample at once)."""

Row = list[int]
"""Indices of the samples that share one row of a batch (one sample without packing)."""


@dataclass(frozen=True)
class RowPlan:
    """Rows of sample indices, in the order they are trained, held as two flat arrays (a few bytes a
    sample, no Python object per sample): row k is `members[bounds[k] : bounds[k + 1]]`."""

    members: np.ndarray
    """(samples,) sample indices, row after row."""
    bounds: np.ndarray
    """(rows + 1,) where each row starts in `members`, then where the last ends."""

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def rows(self, start: int, stop: int) -> list[Row]:
        """Rows start to stop (exclusive) as lists of sample indices."""
        bounds = self.bounds[start : stop + 1].tolist()
        members = self.members[bounds[0] : bounds[-1]].tolist()
        return [members[a - bounds[0] : b - bounds[0]] for a, b in zip(bounds[:-1], bounds[1:])]

    def take(self, picked: np.ndarray) -> RowPlan:
        """The rows `picked`, in that order; -1 picks an empty row."""
        real = picked >= 0
        firsts = np.where(real, self.bounds[np.maximum(picked, 0)], 0)
        counts = np.where(real, self.bounds[np.maximum(picked, 0) + 1] - firsts, 0)
        bounds = np.zeros(len(picked) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        # Member j of the result is member (j - bounds[k]) of picked row k: shift each row's run.
        where = np.repeat(firsts - bounds[:-1], counts)
        where += np.arange(bounds[-1])
        return RowPlan(self.members[where], bounds)

    @staticmethod
    def one_sample_each(samples: np.ndarray) -> RowPlan:
        return RowPlan(samples, np.arange(len(samples) + 1, dtype=np.int64))


def pack_rows(lengths: np.ndarray, order: np.ndarray, capacity: int) -> RowPlan:
    """Best-fit decreasing: longest sample first, each into the fullest row it still fits in; rows in the
    order they were opened, each row's samples in the order they went in.

    Samples of equal length are taken in `order`, so a new order gives new rows of the same shapes
    (the row count does not change between epochs).
    """
    lengths = np.asarray(lengths)
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    free: list[tuple[int, int]] = []  # (room left, row index), sorted: the first fit is the best fit
    row_of = array("i")  # each sample's row, in by_length order: 4 bytes a sample, not a Python int
    num_rows = 0
    for block in range(0, len(by_length), PACKED_BLOCK):
        for need in lengths[by_length[block : block + PACKED_BLOCK]].tolist():
            slot = bisect_left(free, (need, -1))
            if slot < len(free):
                room, row = free.pop(slot)
            else:
                room, row = capacity, num_rows
                num_rows += 1
            row_of.append(row)
            if room - need > 0:
                insort(free, (room - need, row))
    row_of_sample = np.frombuffer(row_of, dtype=np.intc)
    bounds = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of_sample, minlength=num_rows), out=bounds[1:])
    # Stable: within a row, the samples stay in the order they went in.
    return RowPlan(by_length[np.argsort(row_of_sample, kind="stable")], bounds)


def plan_epoch(
    positions: np.ndarray,
    capacity: int,
    packing: bool,
    global_batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> RowPlan:
    """The rows of one epoch in the order they are trained, global batch after global batch of
    `global_batch_size` rows: the incomplete last one dropped when shuffling (training) and filled with
    empty rows otherwise (evaluation). Of each global batch only rank `rank`'s share is kept, its
    `global_batch_size / world_size` consecutive rows: every rank plans the same epoch and holds its own
    rows alone (the default, one rank, is the whole epoch)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(positions)) if shuffle else np.arange(len(positions))
    if packing:
        rows = pack_rows(positions, order, capacity)
        picked = rng.permutation(len(rows)) if shuffle else np.arange(len(rows))
    else:
        chunk = global_batch_size * LENGTH_GROUPING_FACTOR
        by_length = np.empty_like(order)
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            by_length[start : start + chunk] = part[np.argsort(-positions[part], kind="stable")]
        rows = RowPlan.one_sample_each(by_length)
        picked = np.arange(len(rows))
    if shuffle:
        picked = picked[: len(picked) - len(picked) % global_batch_size]
    else:
        picked = np.concatenate([picked, np.full(-len(picked) % global_batch_size, -1)])
    batches = picked.reshape(-1, global_batch_size)
    if shuffle and not packing:
        batches = batches[rng.permutation(len(batches))]
    share = global_batch_size // world_size
    return rows.take(batches[:, rank * share : (rank + 1) * share].reshape(-1))


def collate(
    samples: Samples,
    rows: list[Row],
    seq_length: int | None,
    pad_id: int,
    sequences: bool = False,
    per_sample: dict[str, np.ndarray] | None = None,
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

    sequences: also `sequence_samples` (S,), the sample index of each sequence the model's per-sequence loss
        sums over (each packed document, else each row; -1 for an empty row), `sequence_targets` (S,) its
        target tokens, and for each array of `per_sample` (one value per sample, e.g. a preference
        objective's reference log-probabilities) its values at those samples (0 for an empty row).
    """
    starts, lengths, tokens, targets = samples.starts, samples.lengths, samples.tokens, samples.targets
    used = [sum(int(lengths[i]) - 1 for i in row) for row in rows]
    length = seq_length if seq_length is not None else max([1, *used])
    input_ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((len(rows), length), dtype=np.int64)
    document_ids = np.full((len(rows), length), PAD_DOCUMENT_ID, dtype=np.int64)
    document_lengths = []
    sequence_samples: list[int] = []
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
                if seq_length is not None:
                    sequence_samples.append(i)
            cursor += n
        if seq_length is None:
            sequence_samples.append(row[0] if row else -1)
            # right padding continues the positions; it is never attended to
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
    if sequences:
        index = np.asarray(sequence_samples, dtype=np.int64)
        real = index >= 0
        counts = [
            int(targets[int(starts[i]) + 1 : int(starts[i]) + int(lengths[i])].sum()) if i >= 0 else 0
            for i in sequence_samples
        ]
        batch["sequence_samples"] = torch.from_numpy(index)
        batch["sequence_targets"] = torch.tensor(counts, dtype=torch.int64)
        for name, values in (per_sample or {}).items():
            batch[name] = torch.from_numpy(np.where(real, values[np.maximum(index, 0)], 0))
    return batch


class _MicroBatches(Dataset):
    """Micro-batch k of one rank's epoch, built on demand (in a worker process when there are any)."""

    def __init__(
        self,
        samples: Samples,
        rows: RowPlan,
        micro_batch_size: int,
        seq_length: int | None,
        pad_id: int,
        samples_per_unit: int = 1,
        per_sample: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.samples, self.rows, self.micro_batch_size = samples, rows, micro_batch_size
        self.seq_length, self.pad_id = seq_length, pad_id
        self.samples_per_unit, self.per_sample = samples_per_unit, per_sample

    def __len__(self) -> int:
        return len(self.rows) // self.micro_batch_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        micro = self.micro_batch_size
        units = self.rows.rows(index * micro, (index + 1) * micro)
        rows = units_as_rows(units, self.samples_per_unit, packed=self.seq_length is not None)
        grouped = self.samples_per_unit > 1
        return collate(self.samples, rows, self.seq_length, self.pad_id, grouped, self.per_sample)


def units_as_rows(rows: list[Row], samples_per_unit: int, packed: bool) -> list[Row]:
    """Rows of units (preference pairs: `samples_per_unit` consecutive samples each) as rows of samples: a
    packed row holds its units' samples one after another, an unpacked row's unit becomes one row per sample
    (an empty filler row, as many empty rows)."""
    if samples_per_unit == 1:
        return rows
    group = range(samples_per_unit)
    if packed:
        return [[samples_per_unit * unit + j for unit in row for j in group] for row in rows]
    return [
        [samples_per_unit * unit + j] if row else [] for row in rows for unit in (row or [0]) for j in group
    ]


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
        samples_per_unit: int = 1,
    ) -> None:
        self.geometry = StepGeometry.of(global_batch_size, micro_batch_size, world_size)
        self.samples = samples
        if len(samples) and int(samples.lengths.max()) - 1 > max_seq_length:
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
        self.samples_per_unit = samples_per_unit
        """Samples dealt together as one unit (2: a preference pair's chosen and rejected), which rows,
        micro-batches and ranks never split; batch sizes count units (packed: rows of units)."""
        self.per_sample: dict[str, np.ndarray] = {}
        """Values of each sample that batches carry per sequence (see `collate`)."""
        self.epoch = 0
        self.position = 0
        """Micro-batches of the current epoch already handed out."""
        self._share: tuple[int, RowPlan] | None = None
        """(epoch, this rank's rows of it): the only plan kept, 1 / world_size of the epoch's rows."""

    @property
    def micro_batches_per_global_batch(self) -> int:
        return self.geometry.accumulation_steps

    @property
    def positions(self) -> np.ndarray:
        """The positions each unit fills in a row (its samples' tokens but one each)."""
        if self.samples_per_unit == 1:
            return self.samples.lengths - 1
        return (self.samples.lengths - 1).reshape(-1, self.samples_per_unit).sum(axis=1)

    def plan(self, epoch: int | None = None, rank: int | None = None, world_size: int = 1) -> RowPlan:
        """The epoch's rows in the order they are trained (the same on every rank), global batch after
        global batch; with a rank, only that rank's share of each (see `plan_epoch`)."""
        return plan_epoch(
            self.positions,
            self.max_seq_length,
            self.packing,
            self.global_batch_size,
            self.seed,
            self.epoch if epoch is None else epoch,
            self.shuffle,
            0 if rank is None else rank,
            world_size,
        )

    def share(self, epoch: int | None = None, rank: int | None = None) -> RowPlan:
        """A rank's rows of the epoch, micro-batch after micro-batch. This rank's is kept for the epoch:
        the only plan a loader holds."""
        epoch = self.epoch if epoch is None else epoch
        rank = self.rank if rank is None else rank
        if rank != self.rank:
            return self.plan(epoch, rank, self.world_size)
        if self._share is None or self._share[0] != epoch:
            self._share = None  # let the last epoch's rows go before planning the next
            self._share = (epoch, self.plan(epoch, rank, self.world_size))
            release_freed_heap()  # the whole epoch's plan, let go: it would stay resident in every rank
        return self._share[1]

    def global_batches(self, epoch: int | None = None) -> list[list[Row]]:
        """The epoch's global batches as lists of rows (the same on every rank): for inspection."""
        plan, size = self.plan(epoch), self.global_batch_size
        return [plan.rows(start, start + size) for start in range(0, len(plan), size)]

    def micro_batches(self, epoch: int | None = None, rank: int | None = None) -> list[list[Row]]:
        """A rank's micro-batches of the epoch (this rank's by default), as rows of sample indices."""
        rows, micro = self.share(epoch, rank), self.micro_batch_size
        return [rows.rows(start, start + micro) for start in range(0, len(rows), micro)]

    def __len__(self) -> int:
        return len(self.share()) // self.micro_batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset = _MicroBatches(
            self.samples,
            self.share(),
            self.micro_batch_size,
            self.max_seq_length if self.packing else None,
            self.pad_id,
            self.samples_per_unit,
            self.per_sample,
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
