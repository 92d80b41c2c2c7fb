"""Tokenized samples as views into two flat arrays (memory-mapped when read from the cache), written to the
cache a chunk at a time (by worker processes, each replaced after CHUNKS_PER_WORKER chunks), truncated and
split without copying a token, and counted from the cache a block at a time (`count_lengths`).

A cache entry holds `tokens.bin` (int32) and `targets.bin` (bool), every sample back to back, and
`lengths.npy` and `first_targets.npy` (int64, one per sample). The flat arrays are plain numpy memory maps:
each rank maps the same files, so loading costs a rank only the pages it reads, the ranks of a node share
those pages in the page cache, and no library is needed beyond numpy. `first_targets` (where a sample's
first loss token after its first token lies) lets truncation decide which samples keep a target without
reading the tokens. In memory the per-sample arrays are int32 for sets under 2^31 tokens (`offset_dtype`):
12 bytes a sample for where each starts, its length and its first target, which is what every rank holds.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from litsft.data.chat import ChatFormat, ConversationError, Message, Tokenized, TokenizeReport
from litsft.errors import LitsftError
from litsft.runtime.files import publish_atomically, write_json
from litsft.runtime.heap import release_freed_heap
from litsft.runtime.run_lock import holder_alive, process_start_time


@dataclass
class Samples:
    """Sample i is tokens[starts[i] : starts[i] + lengths[i]]; targets marks loss tokens."""

    tokens: np.ndarray
    """(N,) int32 token ids, possibly memory-mapped and shared by other Samples (a split, a truncation)."""
    targets: np.ndarray
    """(N,) bool: True where the token is a loss target."""
    starts: np.ndarray
    """(num_samples,) where each sample starts in tokens (int32 under 2^31 tokens, see `offset_dtype`)."""
    lengths: np.ndarray
    """(num_samples,) tokens of each sample (the same dtype)."""
    first_targets: np.ndarray
    """(num_samples,) position, within its sample, of each sample's first target after its first
    token (nothing precedes a first token: it is never a label); the sample's length when there is none."""

    @classmethod
    def back_to_back(cls, tokens: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> Samples:
        """Samples stored one after another: sample i's tokens follow sample i - 1's."""
        lengths = np.asarray(lengths, dtype=np.int64)
        dtype = offset_dtype(int(lengths.sum()))
        starts = starts_of(lengths, dtype)
        first_targets = first_targets_of(targets, starts, lengths)
        return cls(tokens, targets, starts, lengths.astype(dtype), first_targets.astype(dtype))

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets) of sample `index`."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        return self.tokens[start : start + length], self.targets[start : start + length]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def subset(self, indices: np.ndarray) -> Samples:
        """The samples at `indices`, in that order, or where the boolean mask `indices` is True (a view:
        no token is copied)."""
        return Samples(
            self.tokens,
            self.targets,
            self.starts[indices],
            self.lengths[indices],
            self.first_targets[indices],
        )

    def truncate(self, max_tokens: int) -> tuple[Samples, int]:
        """Keep the first `max_tokens` tokens of each sample and drop the samples left without any target
        (the first token of a sample is never a target: nothing precedes it). Returns (samples, dropped);
        a view: no token is copied or read."""
        # A limit past the dtype's largest value cuts nothing (and numpy refuses to compare with it).
        lengths = np.minimum(self.lengths, min(max_tokens, np.iinfo(self.lengths.dtype).max))
        keep = self.first_targets < lengths
        truncated = Samples(
            self.tokens, self.targets, self.starts, lengths, np.minimum(self.first_targets, lengths)
        )
        if keep.all():
            return truncated, 0
        return truncated.subset(keep), len(self) - int(keep.sum())

    def __getstate__(self) -> dict[str, object]:
        # A memory-mapped array would pickle as its whole contents (to a loader worker started by spawn or
        # forkserver): it travels as its file instead, mapped again on arrival.
        return {name: _MappedFile.of(value) for name, value in self.__dict__.items()}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value.open() if isinstance(value, _MappedFile) else value)

    def save(self, directory: Path) -> None:
        """Write these samples back to back as a cache entry (see the module docstring)."""
        with SamplesWriter(directory) as writer:
            for index in range(len(self)):
                tokens, targets = self.sample(index)
                writer.append(tokens, targets, self.lengths[index : index + 1])

    @classmethod
    def load(cls, directory: Path) -> Samples:
        """The samples of a cache entry, their tokens and targets memory-mapped read-only, the per-sample
        arrays read into `offset_dtype` a block at a time (never as the files' int64 whole)."""
        total = (directory / "tokens.bin").stat().st_size // np.dtype(np.int32).itemsize
        dtype = offset_dtype(total)
        lengths, summed = _read_per_sample(directory / "lengths.npy", dtype)
        first_targets, _ = _read_per_sample(directory / "first_targets.npy", dtype)
        # The lengths' exact sum (in int64) is the token count: so each fits `dtype`, and the files agree.
        if summed != total or len(first_targets) != len(lengths):
            raise LitsftError(
                f"the data cache entry {directory} is damaged (its lengths add up to {summed} tokens, "
                f"tokens.bin holds {total}); delete it and prepare again"
            )
        if total == 0:  # numpy cannot map an empty file
            tokens, targets = np.zeros(0, np.int32), np.zeros(0, bool)
        else:
            tokens = np.memmap(directory / "tokens.bin", dtype=np.int32, mode="r", shape=(total,))
            targets = np.memmap(directory / "targets.bin", dtype=np.bool_, mode="r", shape=(total,))
        return cls(tokens, targets, starts_of(lengths, dtype), lengths, first_targets)


@dataclass(frozen=True)
class _MappedFile:
    """How a read-only memory-mapped array is pickled: the file it maps, and its type and length."""

    path: str
    dtype: str
    length: int

    @staticmethod
    def of(value: object) -> object:
        if isinstance(value, np.memmap) and value.filename is not None:
            return _MappedFile(value.filename, value.dtype.str, len(value))
        return value

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=(self.length,))


def offset_dtype(num_tokens: int) -> type[np.signedinteger]:
    """The dtype of the per-sample arrays of samples holding `num_tokens` tokens in all: int32 when every
    offset into them fits (fewer than 2^31 tokens, so every length and first target fits too), int64
    beyond. Half of int64's bytes a sample, for any set a rank is likely to hold."""
    return np.int32 if num_tokens < 2**31 else np.int64


def starts_of(lengths: np.ndarray, dtype: type[np.signedinteger]) -> np.ndarray:
    """Where each of samples stored back to back starts, summed in `dtype` (their total fits it)."""
    starts = np.zeros(len(lengths), dtype=dtype)
    np.cumsum(lengths[:-1], dtype=dtype, out=starts[1:])
    return starts


def first_targets_of(targets: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each sample's first target position after its first token (its length when none), vectorized."""
    # The first target at or after each sample's second token; the sample's length when it lies beyond it.
    found = np.append(np.flatnonzero(targets), np.iinfo(np.int64).max)
    within = found[np.searchsorted(found, starts + 1)] - starts
    return np.where(within < lengths, within, lengths).astype(np.int64)


class SamplesWriter:
    """Appends samples to a cache entry's files a chunk at a time: memory holds one chunk, never the set.
    The per-sample arrays (lengths, first targets) are streamed to files too and become .npy files on
    closing: at 16 bytes a sample they would be the one thing growing with the set (32 MB at 2M samples)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.files = {
            name: open(self.directory / name, "wb")
            for name in ("tokens.bin", "targets.bin", "lengths.part", "first_targets.part")
        }
        self.num_samples = 0
        self.num_tokens = 0

    def append(self, tokens: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> None:
        """Samples back to back, as tokenizing returns them."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts = starts_of(lengths, np.int64)
        first_targets = first_targets_of(np.asarray(targets), starts, lengths)
        self.files["tokens.bin"].write(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        self.files["targets.bin"].write(np.ascontiguousarray(targets, dtype=np.bool_).tobytes())
        self.files["lengths.part"].write(lengths.tobytes())
        self.files["first_targets.part"].write(first_targets.tobytes())
        self.num_samples += len(lengths)
        self.num_tokens += int(lengths.sum())

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for file in self.files.values():
            file.close()
        if exc_info[0] is None:
            for name in ("lengths", "first_targets"):
                _part_to_npy(
                    self.directory / f"{name}.part", self.directory / f"{name}.npy", self.num_samples
                )


def _part_to_npy(part: Path, npy: Path, length: int) -> None:
    """Raw int64 values streamed to `part` as the (length,) .npy file `npy`: a header, then the values
    copied a block at a time (never the whole array in memory); `part` is removed."""
    with open(npy, "wb") as out, open(part, "rb") as values:
        header = {"descr": np.dtype(np.int64).str, "fortran_order": False, "shape": (length,)}
        np.lib.format.write_array_header_1_0(out, header)
        while block := values.read(1 << 20):
            out.write(block)
    part.unlink()


@dataclass
class LengthCounts:
    """Counts over (some of) a cache entry's samples against rows of `limit` tokens (see `count_lengths`)."""

    limit: int
    samples: int = 0
    tokens: int = 0
    longer: int = 0
    """Samples longer than `limit` tokens."""
    cut_tokens: int = 0
    """Tokens past `limit`, summed over the samples."""
    most_cut: int = 0
    """The most tokens past `limit` in one sample."""
    without_target: int = 0
    """Samples without a target within their first `limit` tokens: what `Samples.truncate(limit)` drops."""


COUNTED_BLOCK = 1 << 16
"""Samples `count_lengths` reads at a time (512 KB each of lengths and first targets). Blocks of 1M samples
(8 MB each, and the copies of what is kept) added 37 MB at their peak counting 2M samples, and left the
main process of a 2M-row prepare with 36 MB more anonymous memory after it than before."""


def count_lengths(directory: Path, limit: int, leave_out: np.ndarray | None = None) -> LengthCounts:
    """Count the samples of the cache entry `directory` (all but the sorted indices `leave_out`) against
    rows of `limit` tokens, reading its per-sample files a block at a time: memory holds one block, never
    one number per sample as `Samples.load` does (12 bytes a sample), and nothing stays mapped."""
    leave_out = np.zeros(0, np.int64) if leave_out is None else leave_out
    counts = LengthCounts(limit)
    with (
        open(directory / "lengths.npy", "rb") as lengths,
        open(directory / "first_targets.npy", "rb") as firsts,
    ):
        total = _npy_length(lengths)
        _npy_length(firsts)
        starts = range(0, total, COUNTED_BLOCK)
        for start, all_lengths, all_firsts in zip(starts, _blocks(lengths, total), _blocks(firsts, total)):
            keep = np.ones(len(all_lengths), bool)
            left = leave_out[
                np.searchsorted(leave_out, start) : np.searchsorted(leave_out, start + len(all_lengths))
            ]
            keep[left - start] = False
            block_lengths, block_firsts = all_lengths[keep], all_firsts[keep]
            cut = block_lengths[block_lengths > limit] - limit
            counts.samples += len(block_lengths)
            counts.tokens += int(block_lengths.sum())
            counts.longer += len(cut)
            counts.cut_tokens += int(cut.sum())
            counts.most_cut = max(counts.most_cut, int(cut.max(initial=0)))
            counts.without_target += int((block_firsts >= np.minimum(block_lengths, limit)).sum())
    return counts


def _read_per_sample(path: Path, dtype: type[np.signedinteger]) -> tuple[np.ndarray, int]:
    """The int64 .npy file `path` (as `SamplesWriter` writes them) read into an array of `dtype` a block
    at a time, and the exact sum of its values (in Python ints)."""
    with open(path, "rb") as file:
        length = _npy_length(file)
        values, summed, start = np.empty(length, dtype=dtype), 0, 0
        for block in _blocks(file, length):
            values[start : start + len(block)] = block
            start += len(block)
            summed += int(block.sum())
    return values, summed


def _blocks(file: BinaryIO, length: int) -> Iterator[np.ndarray]:
    """The `length` int64 values `file` holds from where it is (after `_npy_length`), COUNTED_BLOCK at a
    time; a file that ends before them is a LitsftError naming it."""
    for start in range(0, length, COUNTED_BLOCK):
        count = min(COUNTED_BLOCK, length - start)
        block = np.fromfile(file, np.int64, count)
        if len(block) < count:
            raise LitsftError(f"{file.name} is cut short; delete its cache entry and prepare again")
        yield block


def _npy_length(file: BinaryIO) -> int:
    """The length of the 1-D int64 .npy file `file` (as `SamplesWriter` writes them), read from its header;
    the file is left at its first value."""
    version = np.lib.format.read_magic(file)
    if version == (1, 0):
        (length,), _, dtype = np.lib.format.read_array_header_1_0(file)
    else:
        (length,), _, dtype = np.lib.format.read_array_header_2_0(file)
    if dtype != np.int64:
        raise LitsftError(
            f"{file.name} holds {dtype} values, not int64; delete its cache entry and prepare again"
        )
    return length


def tokenize_conversations(
    conversations: Sequence[list[Message]], chat_format: ChatFormat
) -> tuple[Samples, TokenizeReport]:
    """Render and tokenize every conversation (no truncation) into memory, and report what was left out
    (see `tokenize_to_cache`, which writes them to a cache entry instead and holds one chunk at a time)."""
    parts: list[Tokenized] = []
    report = _tokenize_in_chunks(conversations, chat_format, parts.append)
    if not parts:
        return Samples.back_to_back(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64)), report
    # A conversation trained turn by turn gives several samples: count samples, not conversations.
    samples = Samples.back_to_back(
        np.concatenate([part.tokens for part in parts]),
        np.concatenate([part.targets for part in parts]),
        np.concatenate([part.lengths for part in parts]),
    )
    return samples, report


def tokenize_to_cache(
    conversations: Sequence[list[Message]],
    chat_format: ChatFormat,
    directory: Path,
    description: str = "Tokenizing",
    show_progress: bool = False,
    processes: int | None = None,
) -> TokenizeReport:
    """Render and tokenize every conversation (no truncation) into the cache entry files of `directory`,
    one chunk at a time (memory holds a chunk per process, never the whole set), with a progress bar
    (records/s and time left) when `show_progress`; report what was left out. `processes` tokenize
    (see `tokenizing_processes`)."""
    with SamplesWriter(directory) as writer:
        report = _tokenize_in_chunks(
            conversations,
            chat_format,
            lambda part: writer.append(part.tokens, part.targets, part.lengths),
            description if show_progress else None,
            processes,
        )
    return report


def _tokenize_in_chunks(
    conversations: Sequence[list[Message]],
    chat_format: ChatFormat,
    consume: Callable[[Tokenized], None],
    progress: str | None = None,
    processes: int | None = None,
) -> TokenizeReport:
    """Tokenize chunk by chunk, in worker processes for large sets, handing each chunk to `consume` in
    order. A conversation that cannot be trained on is named by its record (`where` of the conversations,
    e.g. file and line, asked by the process that tokenized its chunk, which has just read it): in the
    report's skipped list (the problem prefixed with it), or in the LitsftError that stops tokenizing when
    the chat format does not skip.

    `conversations` is any sequence that slices: a list, or a lazy view over a dataset's rows (see
    hf_dataset.py), of which only a few chunks of CHUNK_SIZE conversations per process are held at a time."""
    bar = progress_bar(len(conversations), progress) if progress else None
    reports = []
    try:
        for part in _chunks(conversations, chat_format, processes):
            consume(part)
            # What receiving and writing the chunk freed (its pickled bytes, the arrays computed to write it)
            # stays resident otherwise, in this thread's heap and the pool's result thread's: the main
            # process grew by about 8 MB a chunk of ~340-token conversations (anonymous memory 80 MB after
            # the 2nd chunk, 130 MB after the 8th; with this, 66-67 MB from the 4th on), and a worker forked
            # to replace another starts with what it has.
            release_freed_heap()
            reports.append(part.report)
            if bar is not None:
                bar.update(part.report.conversations)
    except ConversationError as err:
        raise LitsftError(err.problem) from None  # named by its record where it was tokenized
    finally:
        if bar is not None:
            bar.close()
    return TokenizeReport.joined(reports)


PROGRESS_DELAY_S = 2.0
"""The progress bar appears once tokenizing has taken this long: a set that takes less needs none, and a
refusal that follows it (bad weights, a bad option) stays the one line on stderr."""


def progress_bar(total: int, description: str, unit: str = " records"):  # noqa: ANN202 (tqdm, imported lazily)
    """A progress bar on stderr that appears once PROGRESS_DELAY_S have passed; "B": counting bytes (kB,
    MB, ... and their rate)."""
    import tqdm

    # No monitor thread: a running thread keeps tokenizing from forking workers (see _chunks).
    tqdm.tqdm.monitor_interval = 0
    return tqdm.tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        mininterval=2.0,
        delay=PROGRESS_DELAY_S,
        dynamic_ncols=True,
    )


def tokenizing_processes(num_conversations: int, requested: int | None = None) -> int:
    """How many processes tokenize `num_conversations`: `requested` (--data.tokenize_processes) when
    given, else one per core this process may run on, at most MAX_PROCESSES; never more than one per chunk."""
    num_chunks = -(-num_conversations // CHUNK_SIZE)
    if requested is not None:
        return max(1, min(num_chunks, requested))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(num_chunks, cores, MAX_PROCESSES))


def _chunks(
    conversations: Sequence[list[Message]], chat_format: ChatFormat, requested: int | None
) -> Iterator[Tokenized]:
    num_chunks = -(-len(conversations) // CHUNK_SIZE)
    processes = tokenizing_processes(len(conversations), requested)
    if processes == 1:
        for index in range(num_chunks):
            yield _tokenize_chunk_of(conversations, index, chat_format)
        return
    # Forking while other threads run (a training run's: the launcher's, the out_dir lock's heartbeat,
    # gloo's) can deadlock the children on a lock one of those threads held. A single-threaded process
    # (`litsft prepare_sft`) forks, and its workers inherit the conversations and the compiled template; any
    # other starts its workers from a fresh server process (forkserver), which unpickles them once per
    # worker (parquet rows, and a `datasets` dataset, pickle as the paths of their files). A worker that has
    # tokenized CHUNKS_PER_WORKER chunks is replaced by the pool's own thread, the same way; those threads
    # wait on the pool's pipes and hold no lock a worker takes.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(
        processes,
        initializer=_install_work,
        initargs=(conversations, chat_format, CHUNK_SIZE),
        maxtasksperchild=CHUNKS_PER_WORKER,
    ) as pool:
        # imap: chunks come back in order, and a chunk is written as soon as it and those before it are
        # done, so only the chunks in flight are held.
        yield from pool.imap(_tokenize_chunk, range(num_chunks))


def _install_work(conversations: Sequence[list[Message]], chat_format: ChatFormat, chunk_size: int) -> None:
    global _WORK, CHUNK_SIZE
    # The chunks this process was asked for: a worker started from the server process imports this
    # module afresh (a test's smaller CHUNK_SIZE would not reach it).
    _WORK, CHUNK_SIZE = (conversations, chat_format), chunk_size


CHUNK_SIZE = 10_000
MAX_PROCESSES = 16
CHUNKS_PER_WORKER = 16
"""A tokenizing worker is replaced by a fresh one after this many chunks. The rows a worker reads from a
memory-mapped dataset (`datasets`' arrow cache, for sources other than parquet) stay mapped in it, about 1.2 MB a chunk of ShareGPT rows,
so a worker that lived through the set would hold its share of the whole file (133 MB at 2M rows with two
workers); a fresh one starts with none of it. A replacement is forked (or started from the server process
and given the conversations and chat format again) while the other workers go on."""
_WORK: tuple[Sequence[list[Message]], ChatFormat] | None = None


def _tokenize_chunk(index: int) -> Tokenized:
    conversations, chat_format = _WORK
    part = _tokenize_chunk_of(conversations, index, chat_format)
    # The chunk's rows, rendered text and token lists are freed here, but glibc keeps most of that heap
    # resident below what stays alive (see runtime/heap.py), chunk after chunk.
    release_freed_heap()
    return part


def _tokenize_chunk_of(
    conversations: Sequence[list[Message]], index: int, chat_format: ChatFormat
) -> Tokenized:
    # Indices within the chunk are made indices into all conversations, and the conversations left out
    # are named here, by the process that has just read their records (a file's reader keeps their lines).
    start = index * CHUNK_SIZE
    where = getattr(conversations, "where", lambda index: f"record {index + 1}")
    try:
        part = chat_format.tokenize_many(conversations[start : start + CHUNK_SIZE])
    except ConversationError as err:
        raise ConversationError(start + err.index, f"{where(start + err.index)}: {err.problem}") from None
    report = part.report.shifted(start)
    report.skipped = [(index, f"{where(index)}: {problem}") for index, problem in report.skipped]
    return part._replace(report=report)


CACHE_FIX = "set --data.cache_dir (or $LITSFT_CACHE_DIR) to a writable place with free space"
STAGING_NAME = re.compile(r"\.(?P<entry>[^.]+)\.tmp-(?P<host>.+)\.(?P<pid>\d+)\.(?P<start_time>\d+)")
"""The staging folder of a cache entry being written, `.<entry>.tmp-<host>.<pid>.<start time>`: who writes it,
so that a later preparation can tell a dead writer's leftover from a live one's (as run_lock.py tells a
dead run's lock from a live one's)."""
FOREIGN_LEFTOVER_AFTER_S = 3600.0
"""A staging folder written on another host (a shared cache), or named by an earlier litsft without its
writer, is a leftover once nothing in it has changed for this long: a live writer appends every chunk."""


def write_atomically(directory: Path, write: Callable[[Path], dict | None], meta: dict) -> None:
    """Write a cache entry into a temporary sibling and rename it into place, so a crash or a concurrent
    writer never leaves a half-written entry that a later run would trust. `write` fills the folder and
    may return more of its meta (what it counted while writing). What earlier writers that died (killed,
    out of memory, a lost node) left in their staging folders beside it is removed first."""
    remove_dead_leftovers(directory.parent)
    start_time = process_start_time(os.getpid()) or 0
    staging = directory.parent / f".{directory.name}.tmp-{socket.gethostname()}.{os.getpid()}.{start_time}"
    try:
        with publish_atomically(directory, "the data cache", staging, fix=CACHE_FIX) as staging:
            written = write(staging)
            write_json(staging / "meta.json", {**meta, **(written or {})})
    except LitsftError:
        if not (directory / "meta.json").is_file():  # else another process published the same entry
            raise


def remove_dead_leftovers(folder: Path) -> None:
    """Remove the staging folders in `folder` whose writers are gone (see STAGING_NAME and
    FOREIGN_LEFTOVER_AFTER_S), each named in one line: the tokens a killed preparation wrote (about 5
    bytes a token) would otherwise stay there for good, whatever later preparations do."""
    for path in folder.glob(".*.tmp-*") if folder.is_dir() else []:
        try:
            if not path.is_dir() or _writer_alive(path):
                continue
            size = sum(file.stat().st_size for file in path.iterdir())
        except OSError:  # removed meanwhile (its writer published it, or another run removed it)
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            print(f"Removed {path} ({size / 1e6:,.0f} MB), left by a preparation that is gone", flush=True)


def _writer_alive(staging: Path) -> bool:
    named = STAGING_NAME.fullmatch(staging.name)
    if named is not None and named["host"] == socket.gethostname():
        writer = {
            "host": named["host"],
            "pid": int(named["pid"]),
            "start_time": int(named["start_time"]) or None,
        }
        return holder_alive(writer, age_s=0.0)
    changed = max([staging.stat().st_mtime, *(file.stat().st_mtime for file in staging.iterdir())])
    return time.time() - changed < FOREIGN_LEFTOVER_AFTER_S
