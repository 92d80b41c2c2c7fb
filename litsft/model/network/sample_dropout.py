"""LoRA's dropout, with every mask drawn from the sample it applies to.

A dropout mask drawn from each rank's random stream depends on which rank a sample lands on and how many
samples that rank drew masks for before it: one process and two FSDP processes then train differently from
the first update, and a run resumed on another number of processes reseeds every mask. Here the mask of a
sample's tokens in one adapter is drawn from a generator seeded with (run seed, optimizer step, the sample's
position in the step's global batch, the adapter's index in the model), so the same global batch gives the
same masks however it is cut into micro-batches, accumulation steps and ranks, and whatever was drawn before.

The training step says, per micro-batch, where each sample's tokens are in the model's input
(`samples_in_micro_batch`, `dropout_samples`); the forward and the backward pass (where activation
checkpointing recomputes the masks) run inside that context. Outside it (a unit test, a hand-written loop)
`SampleDropout` is ordinary dropout drawn from torch's default generator.

The masks keep a value with probability 1 - p and scale it by 1 / (1 - p), as `nn.Dropout` does; a keep
decision compares 31 random bits with p * 2^31 (two decisions per 64-bit draw, about 3/4 of the cost of
torch's CPU Bernoulli sampling, which was 15% of a LoRA step on this project's CPU benchmark).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from litsft.model.network.context_parallel import ContextShard

_MASK_64 = 2**64 - 1


def _splitmix64(value: int) -> int:
    """One step of splitmix64 (Steele et al. 2014, https://prng.di.unimi.it/splitmix64.c): a 64-bit mix in which
    every input bit changes about half of the output bits, so that nearby keys give unrelated seeds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


def mix_key(*values: int) -> int:
    """A 63-bit seed (what `torch.Generator.manual_seed` takes) from non-negative integers, order mattering."""
    key = 0
    for value in values:
        key = _splitmix64(key ^ (value & _MASK_64))
    return key >> 1


@dataclass(frozen=True)
class DropoutSamples:
    """Where each sample of a micro-batch is in the model's input, flattened to its tokens (B * T): sample i
    covers tokens [starts[i], starts[i] + lengths[i]) and its masks come from `keys[i]`. The other tokens
    (right padding) keep their values: nothing attends to them and they carry no loss."""

    keys: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: int
    """B * T of the model's input."""
    local: tuple[int, int] | None = None
    """Context parallelism: this rank's model input is tokens [start, stop) of the whole input (`tokens` is the
    whole one's), whose masks are this rank's slice of the whole samples' (`context_samples`)."""


_current: DropoutSamples | None = None
"""The micro-batch being trained. A module global, not a context variable: autograd runs a GPU's backward
pass (and the recomputation of checkpointed activations in it) on a thread of its own."""
_head_rows: torch.Tensor | None = None
"""Which tokens of the input the rows reaching an adapter are, where they are not all of them: the output
head runs on the tokens that carry a loss, a chunk at a time (`head_rows`)."""


def samples_in_micro_batch(
    row_lengths: Sequence[int], row_width: int, joined: bool, first_position: int, seed: int, step: int
) -> DropoutSamples:
    """The samples (rows) of one micro-batch as the model sees them.

    Args:
        row_lengths: The real tokens of each row (the collate's `row_lengths`).
        row_width: T, the padded length of the rows.
        joined: Whether the model's input is the rows' real tokens joined into one row (packed batches,
            `litsft.model.network.batch.model_inputs`), rather than the (B, T) rows with their padding.
        first_position: The position of the first row in the step's global batch.
        seed: The run's seed.
        step: The optimizer step (counted from 1) the micro-batch belongs to.
    """
    starts, cursor = [], 0
    for row, length in enumerate(row_lengths):
        starts.append(cursor if joined else row * row_width)
        cursor += length
    keys = tuple(mix_key(seed, step, first_position + row) for row in range(len(row_lengths)))
    tokens = cursor if joined else len(row_lengths) * row_width
    return DropoutSamples(keys, tuple(starts), tuple(int(n) for n in row_lengths), tokens)


def context_samples(samples: DropoutSamples, shard: ContextShard, padded_width: int) -> DropoutSamples:
    """The samples of a context rank (litsft.model.network.context_parallel): `samples` are the whole
    micro-batch's (`samples_in_micro_batch` of the model input before `split_for_context`), whose tokens lie in
    that order at the start of the one row of `padded_width` tokens split_for_context makes of them; this rank
    holds its contiguous slice of that row, and draws for it exactly the mask values one process draws."""
    local = shard.local(padded_width)
    return replace(samples, tokens=padded_width, local=(local.start, local.stop))


@contextmanager
def dropout_samples(model: nn.Module, samples: DropoutSamples) -> Iterator[None]:
    """Draw `model`'s adapter dropout masks per sample of `samples` inside the block (forward and backward)."""
    global _current
    _number_dropouts(model)
    previous, _current = _current, samples
    try:
        yield
    finally:
        _current = previous


@contextmanager
def head_rows(rows: torch.Tensor | None) -> Iterator[None]:
    """The rows reaching the output head are these tokens of the input (flat indices), not all of them."""
    global _head_rows
    previous, _head_rows = _head_rows, rows
    try:
        yield
    finally:
        _head_rows = previous


def _number_dropouts(model: nn.Module) -> None:
    """Give each SampleDropout of `model` its index, in module order: the same in every process and under
    any wrapper (FSDP, activation checkpointing and compile keep the order of modules)."""
    if getattr(model, "_sample_dropouts_numbered", False):
        return
    dropouts = [module for module in model.modules() if isinstance(module, SampleDropout)]
    for index, module in enumerate(dropouts):
        module.index = index
    model._sample_dropouts_numbered = True


_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device, seed: int) -> torch.Generator:
    generator = _generators.get(device)
    if generator is None:
        generator = _generators[device] = torch.Generator(device=device)
    return generator.manual_seed(seed)


def keep_scale(
    shape: tuple[int, ...],
    p: float,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A dropout mask of `shape`: 1 / (1 - p) where a value is kept (probability 1 - p), else 0, written into
    `out` when given. Each 64-bit draw gives two 31-bit integers, each compared with p * 2^31 (p exact to
    2^-31)."""
    count = 1
    for size in shape:
        count *= size
    bits = torch.empty((count + 1) // 2, dtype=torch.int64, device=device).random_(generator=generator)
    halves = bits.view(torch.int32)[:count].view(shape).bitwise_and_(0x7FFFFFFF)  # 31 uniform bits each
    threshold = round(p * 2**31)
    keep = halves >= threshold
    out = keep.to(dtype) if out is None else out.copy_(keep)
    return out.mul_(2**31 / (2**31 - threshold))


class SampleDropout(nn.Dropout):
    """Dropout on an adapter's input whose masks come from the samples they apply to (module docstring)."""

    index: int | None = None
    """This adapter's place among the model's adapters (`dropout_samples` numbers them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if _current is None or self.index is None:
            return x * keep_scale(tuple(x.shape), self.p, x.dtype, x.device, None)
        return x * self._sample_masks(x)

    @torch.compiler.disable  # a Python loop over the micro-batch's rows: dynamo leaves it to eager mode
    def _sample_masks(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, width) masks, sample by sample, shaped as `x`."""
        samples, width = _current, x.shape[-1]
        assert samples is not None and self.index is not None
        if samples.local is not None:
            masks = self._local_masks(samples, samples.local, x)
        else:
            masks = self._whole_masks(samples, x)
        rows = x.numel() // width
        if rows != masks.shape[0]:
            if _head_rows is None or _head_rows.numel() != rows:
                raise RuntimeError(
                    f"an adapter's input has {rows} rows, the micro-batch {masks.shape[0]} tokens, and no "
                    "head_rows say which tokens they are"
                )
            masks = masks[_head_rows.to(masks.device)]
        return masks.view(x.shape)

    def _mask(self, key: int, length: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The (length, width) mask of the sample keyed `key`, always drawn whole from its own generator."""
        assert self.index is not None
        generator = _generator(x.device, mix_key(key, self.index))
        return keep_scale((length, x.shape[-1]), self.p, x.dtype, x.device, generator, out=out)

    def _whole_masks(self, samples: DropoutSamples, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        masks = torch.empty(samples.tokens, width, dtype=x.dtype, device=x.device)
        cursor = 0
        for key, start, length in zip(samples.keys, samples.starts, samples.lengths):
            masks[cursor:start].fill_(1)  # padding
            self._mask(key, length, x, out=masks[start : start + length])
            cursor = start + length
        masks[cursor:].fill_(1)
        return masks

    def _local_masks(self, samples: DropoutSamples, local: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        """Tokens [first, stop) of the whole input's masks. A sample reaching into them has its mask drawn whole
        and sliced: a generator cannot skip ahead to a row exactly (CUDA's Philox offsets advance per call by
        rounded amounts), so each rank draws the whole of the samples it touches, one at a time."""
        first, stop = local
        masks = torch.ones(
            stop - first, x.shape[-1], dtype=x.dtype, device=x.device
        )  # padding keeps its values
        for key, start, length in zip(samples.keys, samples.starts, samples.lengths):
            a, b = max(start, first), min(start + length, stop)
            if a < b:
                masks[a - first : b - first] = self._mask(key, length, x)[a - start : b - start]
        return masks
