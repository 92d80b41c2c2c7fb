"""Tokenized samples held as three flat arrays, cached as .npy files, truncated without Python loops."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from litsft.data.chat import ChatFormat, ConversationError, Message, Tokenized, TokenizeReport
from litsft.errors import LitsftError
from litsft.runtime.files import publish_atomically, write_json


@dataclass
class Samples:
    """Samples back to back: sample i is tokens[offsets[i]:offsets[i + 1]]; targets marks loss tokens."""

    tokens: np.ndarray
    """(N,) int32 token ids."""
    targets: np.ndarray
    """(N,) bool: True where the token is a loss target."""
    offsets: np.ndarray
    """(num_samples + 1,) int64 start of each sample, then the total length."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def subset(self, indices: np.ndarray) -> Samples:
        """The samples at `indices`, in that order."""
        lengths = self.lengths[indices]
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = _ranges(self.offsets[indices], lengths)
        return Samples(self.tokens[gather], self.targets[gather], offsets)

    def truncate(self, max_tokens: int) -> tuple[Samples, int]:
        """Keep the first `max_tokens` tokens of each sample and drop the samples left without any target
        (the first token of a sample is never a target: nothing precedes it). Returns (samples, dropped)."""
        lengths = np.minimum(self.lengths, max_tokens)
        if np.array_equal(lengths, self.lengths):
            # Nothing to cut (the usual case): no gather, whose int64 index arrays would be 8 bytes a token.
            tokens, targets, kept_offsets = self.tokens, self.targets.copy(), self.offsets
        else:
            gather = _ranges(self.offsets[:-1], lengths)
            tokens, targets = self.tokens[gather], self.targets[gather]
            kept_offsets = np.zeros(len(self) + 1, dtype=np.int64)
            np.cumsum(lengths, out=kept_offsets[1:])
        targets[kept_offsets[:-1][lengths > 0]] = False  # nothing precedes a first token
        # Whether each sample keeps a target: an OR over each sample's run (a run between two non-empty
        # samples' starts holds only the first one's tokens: empty samples add nothing).
        has_target = np.zeros(len(self), dtype=bool)
        nonempty = np.flatnonzero(lengths > 0)
        if len(nonempty):
            has_target[nonempty] = np.logical_or.reduceat(targets, kept_offsets[nonempty])
        truncated = Samples(tokens, targets, kept_offsets)
        keep = np.flatnonzero(has_target)
        if len(keep) == len(self):
            return truncated, 0
        return truncated.subset(keep), len(self) - len(keep)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "tokens.npy", self.tokens)
        np.save(directory / "targets.npy", self.targets)
        np.save(directory / "offsets.npy", self.offsets)

    @classmethod
    def load(cls, directory: Path) -> Samples:
        # allow_pickle=False: cache files are data only.
        arrays = [
            np.load(directory / f"{name}.npy", allow_pickle=False)
            for name in ("tokens", "targets", "offsets")
        ]
        return cls(*arrays)


def tokenize_conversations(
    conversations: Sequence[list[Message]], chat_format: ChatFormat
) -> tuple[Samples, TokenizeReport]:
    """Render and tokenize every conversation (no truncation), in worker processes for large sets, and
    report what was left out. A conversation that cannot be trained on is named by its record
    (`Conversations.where`, file and line): in the report's skipped list (the problem prefixed with it),
    or in the LitsftError that stops tokenizing when the chat format does not skip.

    `conversations` is any sequence that slices: a list, or a lazy view over a dataset's rows (see
    hf_dataset.py), of which only one chunk of CHUNK_SIZE conversations per process is held at a time."""
    where = getattr(conversations, "where", lambda index: f"record {index + 1}")
    try:
        samples, report = _tokenize_all(conversations, chat_format)
    except ConversationError as err:
        raise LitsftError(f"{where(err.index)}: {err.problem}") from None
    report.skipped = [(index, f"{where(index)}: {problem}") for index, problem in report.skipped]
    return samples, report


def _tokenize_all(
    conversations: Sequence[list[Message]], chat_format: ChatFormat
) -> tuple[Samples, TokenizeReport]:
    num_chunks = -(-len(conversations) // CHUNK_SIZE)
    processes = min(num_chunks, os.cpu_count() or 1, MAX_PROCESSES)
    # Forking while other threads run (the training launcher's, the out_dir lock's heartbeat, gloo's) can
    # deadlock the children on a lock one of those threads held: fork only from a single-threaded process
    # (`litsft prepare`); inside a run, tokenizers' own thread pool still parallelizes encoding.
    can_fork = threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
    if processes > 1 and can_fork:
        global _WORK
        # Forked workers inherit the conversations and the compiled template instead of pickling them.
        _WORK = (conversations, chat_format)
        try:
            with multiprocessing.get_context("fork").Pool(processes) as pool:
                parts = pool.map(_tokenize_chunk, range(num_chunks))
        finally:
            _WORK = None
    else:
        parts = [_tokenize_chunk_of(conversations, index, chat_format) for index in range(num_chunks)]
    if not parts:
        empty = Samples(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(1, dtype=np.int64))
        return empty, TokenizeReport()
    # A conversation trained turn by turn gives several samples: count samples, not conversations.
    lengths = np.concatenate([part.lengths for part in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    samples = Samples(
        np.concatenate([part.tokens for part in parts]),
        np.concatenate([part.targets for part in parts]),
        offsets,
    )
    return samples, TokenizeReport.joined([part.report for part in parts])


CHUNK_SIZE = 10_000
MAX_PROCESSES = 16
_WORK: tuple[Sequence[list[Message]], ChatFormat] | None = None


def _tokenize_chunk(index: int) -> Tokenized:
    conversations, chat_format = _WORK
    return _tokenize_chunk_of(conversations, index, chat_format)


def _tokenize_chunk_of(
    conversations: Sequence[list[Message]], index: int, chat_format: ChatFormat
) -> Tokenized:
    # Indices within the chunk are made indices into all conversations.
    start = index * CHUNK_SIZE
    try:
        part = chat_format.tokenize_many(conversations[start : start + CHUNK_SIZE])
    except ConversationError as err:
        raise ConversationError(start + err.index, err.problem) from None
    return part._replace(report=part.report.shifted(start))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    # Position within each range, plus that range's start.
    within = np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)
    return within + np.repeat(starts.astype(np.int64), lengths)


CACHE_FIX = "set --data.cache_dir (or $LITSFT_CACHE_DIR) to a writable place with free space"


def write_atomically(directory: Path, write: Callable[[Path], None], meta: dict) -> None:
    """Write a cache entry into a temporary sibling and rename it into place, so a crash or a concurrent
    writer never leaves a half-written entry that a later run would trust."""
    try:
        with publish_atomically(directory, "the data cache", fix=CACHE_FIX) as staging:
            write(staging)
            write_json(staging / "meta.json", meta)
    except LitsftError:
        if not (directory / "meta.json").is_file():  # else another process published the same entry
            raise
