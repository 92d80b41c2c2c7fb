"""litsft/data/samples.py: `Samples` by value (subset and truncation as views, against a Python loop; save and
load memory-mapped, without pickles), and `tokenize_conversations` / `tokenize_to_cache` chunk by chunk with a
stand-in chat format: the chunks joined in order, the cache entry equal to the samples in memory, and a
conversation that cannot be tokenized named by its record wherever its chunk falls."""

from __future__ import annotations

import json
import os
import pickle
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import litsft.data.samples as samples_module
from litsft.data.chat import ConversationError, Tokenized, TokenizeReport
from litsft.data.samples import (
    Samples,
    offset_dtype,
    tokenize_conversations,
    tokenize_to_cache,
    write_atomically,
)
from litsft.errors import LitsftError
from litsft.runtime.run_lock import process_start_time


def three_samples() -> Samples:
    """Samples [1, 2, 3], [] and [4, 5], the last token of each a target."""
    return Samples.back_to_back(
        tokens=np.array([1, 2, 3, 4, 5], dtype=np.int32),
        targets=np.array([False, False, True, False, True]),
        lengths=np.array([3, 0, 2]),
    )


def as_lists(samples: Samples) -> list[tuple[list[int], list[bool]]]:
    return [tuple(array.tolist() for array in samples.sample(i)) for i in range(len(samples))]


def test_subset_gathers_the_samples_in_the_order_given() -> None:
    samples = three_samples()
    assert len(samples) == 3 and samples.lengths.tolist() == [3, 0, 2]
    assert samples.first_targets.tolist() == [2, 0, 1]
    picked = samples.subset(np.array([2, 1, 0]))
    assert as_lists(picked) == [([4, 5], [False, True]), ([], []), ([1, 2, 3], [False, False, True])]
    assert picked.tokens is samples.tokens  # a view: no token copied
    assert len(samples.subset(np.array([], dtype=np.int64))) == 0


def test_first_targets_is_the_python_loop() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 12, 200)
    targets = rng.random(lengths.sum()) < 0.1
    samples = Samples.back_to_back(np.zeros(lengths.sum(), np.int32), targets, lengths)
    for i in range(len(samples)):
        within = np.flatnonzero(samples.sample(i)[1][1:])
        assert samples.first_targets[i] == (within[0] + 1 if len(within) else lengths[i])


@pytest.mark.parametrize("max_tokens", [12, 30])  # 30: no sample is longer, nothing is cut
def test_truncate_is_the_python_loop(max_tokens):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 30, 50)  # an empty sample too (lengths[7] == 0)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    samples = Samples.back_to_back(
        rng.integers(0, 100, offsets[-1]).astype(np.int32), rng.random(offsets[-1]) < 0.2, lengths
    )
    truncated, dropped = samples.truncate(max_tokens)
    expected = []
    for i in range(50):
        tokens = samples.tokens[offsets[i] : offsets[i + 1]][:max_tokens]
        targets = samples.targets[offsets[i] : offsets[i + 1]][:max_tokens]
        if targets[1:].any():  # the first token is never a label: nothing precedes it
            expected.append((tokens.tolist(), targets.tolist()))
    assert as_lists(truncated) == expected and dropped == 50 - len(expected) > 0
    assert truncated.tokens is samples.tokens  # a view: no token copied


def test_save_and_load_round_trip_memory_mapped_and_refuse_pickles(tmp_path: Path) -> None:
    samples = three_samples().subset(np.array([2, 0]))  # a view is saved back to back
    samples.save(tmp_path / "entry")
    loaded = Samples.load(tmp_path / "entry")
    assert as_lists(loaded) == as_lists(samples)
    assert loaded.tokens.dtype == np.int32 and loaded.targets.dtype == np.bool_
    assert isinstance(loaded.tokens, np.memmap) and not loaded.tokens.flags.writeable
    np.testing.assert_array_equal(loaded.first_targets, samples.first_targets)
    Samples.back_to_back(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0)).save(tmp_path / "empty")
    assert len(Samples.load(tmp_path / "empty")) == 0  # an empty file is not mapped
    # Pickled (to a loader worker that is not forked), the mapped arrays travel as their files, mapped again.
    big = Samples.back_to_back(np.arange(100_000, dtype=np.int32), np.ones(100_000, bool), [50_000, 50_000])
    big.save(tmp_path / "big")
    pickled = pickle.dumps(Samples.load(tmp_path / "big").subset(np.array([1])))
    assert len(pickled) < 2000  # not the 500 kB of tokens and targets
    unpickled = pickle.loads(pickled)
    assert isinstance(unpickled.tokens, np.memmap) and as_lists(unpickled) == [as_lists(big)[1]]
    np.save(tmp_path / "entry" / "lengths.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    # Refused from the header, never unpickled: the error names the file and the fix.
    with pytest.raises(LitsftError, match=r"lengths\.npy holds object values, not int64; delete its cache"):
        Samples.load(tmp_path / "entry")


def test_per_sample_arrays_are_int32_below_two_billion_tokens_and_int64_from_there() -> None:
    assert offset_dtype(2**31 - 1) is np.int32 and offset_dtype(2**31) is np.int64
    loaded = three_samples()
    for name in ("starts", "lengths", "first_targets"):
        assert getattr(loaded, name).dtype == np.int32
    # A limit past int32 cuts nothing (numpy refuses to compare an int32 array with it).
    assert as_lists(loaded.truncate(2**40)[0]) == as_lists(loaded.subset(np.array([0, 2])))


def test_loading_reads_the_int64_files_into_int32_block_by_block(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(samples_module, "COUNTED_BLOCK", 7)  # blocks end inside the entry, and at its end
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 50)
    tokens = rng.integers(0, 1000, int(lengths.sum()), dtype=np.int32)
    written = Samples.back_to_back(tokens, rng.random(len(tokens)) < 0.5, lengths)
    written.save(tmp_path / "entry")
    loaded = Samples.load(tmp_path / "entry")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # the reference, in int64
    assert loaded.starts.dtype == loaded.lengths.dtype == loaded.first_targets.dtype == np.int32
    assert loaded.starts.tolist() == starts.tolist() and loaded.lengths.tolist() == lengths.tolist()
    assert loaded.first_targets.tolist() == written.first_targets.tolist()
    assert as_lists(loaded) == as_lists(written)


def test_an_entry_whose_files_disagree_is_named_with_the_fix(tmp_path: Path) -> None:
    three_samples().save(tmp_path / "entry")
    with open(tmp_path / "entry" / "tokens.bin", "r+b") as tokens:
        tokens.truncate(8)  # 2 of its 5 tokens
    with pytest.raises(LitsftError) as error:
        Samples.load(tmp_path / "entry")
    assert str(error.value) == (
        f"the data cache entry {tmp_path / 'entry'} is damaged (its lengths add up to 5 tokens, "
        "tokens.bin holds 2); delete it and prepare again"
    )
    lengths = tmp_path / "entry" / "lengths.npy"
    lengths.write_bytes(lengths.read_bytes()[:-8])  # the last length missing
    with pytest.raises(LitsftError, match=r"lengths\.npy is cut short; delete its cache entry"):
        Samples.load(tmp_path / "entry")


class CountingFormat:
    """Stands in for ChatFormat.tokenize_many: conversation n is the sample [n, n] with its last token a
    target; a conversation ["bad"] cannot be tokenized."""

    def tokenize_many(self, conversations):
        tokens, lengths = [], []
        for index, conversation in enumerate(conversations):
            if conversation == ["bad"]:
                raise ConversationError(index, "no assistant reply")
            tokens += [conversation[0], conversation[0]]
            lengths.append(2)
        targets = np.array([False, True] * len(lengths))
        report = TokenizeReport(conversations=len(conversations))
        return Tokenized(np.array(tokens, dtype=np.int32), targets, np.array(lengths), report)


def test_chunks_are_joined_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samples_module, "CHUNK_SIZE", 2)
    samples, report = tokenize_conversations([[n] for n in range(5)], CountingFormat())
    assert report.conversations == 5 and not report.skipped
    assert as_lists(samples) == [([n, n], [False, True]) for n in range(5)]
    empty, _ = tokenize_conversations([], CountingFormat())
    assert len(empty) == 0


def test_tokenizing_to_the_cache_equals_tokenizing_in_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Written a chunk at a time, on two forked workers, with a progress bar: the same samples."""
    monkeypatch.setattr(samples_module, "CHUNK_SIZE", 3)
    monkeypatch.setattr(samples_module, "tokenizing_processes", lambda count, requested: 2)
    conversations = [[n] for n in range(20)]
    report = tokenize_to_cache(conversations, CountingFormat(), tmp_path / "entry", "Tokenizing", True)
    assert report.conversations == 20
    in_memory, _ = tokenize_conversations(conversations, CountingFormat())
    assert as_lists(Samples.load(tmp_path / "entry")) == as_lists(in_memory)
    # The per-sample arrays, streamed to files while writing, are the files np.save writes of them whole
    # (int64 in the cache, whatever their dtype in memory).
    entry = tmp_path / "entry"
    assert sorted(path.name for path in entry.iterdir()) == [
        "first_targets.npy",
        "lengths.npy",
        "targets.bin",
        "tokens.bin",
    ]
    for name in ("lengths", "first_targets"):
        np.save(tmp_path / f"{name}.npy", getattr(in_memory, name).astype(np.int64))
        assert (entry / f"{name}.npy").read_bytes() == (tmp_path / f"{name}.npy").read_bytes()


@pytest.mark.parametrize("delay", [0.0, 60.0])
def test_the_progress_bar_shows_records_per_second_once_tokenizing_takes_its_delay(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], delay: float
) -> None:
    """A set tokenized within the delay prints nothing (a refusal after it stays one line on stderr); past it,
    the bar names the records and their rate."""
    monkeypatch.setattr(samples_module, "PROGRESS_DELAY_S", delay)
    tokenize_to_cache([[n] for n in range(20)], CountingFormat(), tmp_path / "entry", "Tokenizing", True)
    err = capsys.readouterr().err
    if delay:
        assert err == ""
    else:
        assert "Tokenizing: 100%" in err and "20/20" in err and "records/s" in err


class Records(list):
    """A list of conversations that names its records by file and line, as the data modules' readers do."""

    def where(self, index: int) -> str:
        return f"data.jsonl line {index + 1}"


def test_a_conversation_that_cannot_be_tokenized_is_named_by_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(samples_module, "CHUNK_SIZE", 2)
    conversations = [[0], [1], [2], ["bad"], [4]]  # the second item of the second chunk
    with pytest.raises(LitsftError) as error:
        tokenize_conversations(conversations, CountingFormat())
    assert str(error.value) == "record 4: no assistant reply"
    with pytest.raises(LitsftError) as error:
        tokenize_conversations(Records(conversations), CountingFormat())
    assert str(error.value) == "data.jsonl line 4: no assistant reply"


def test_a_cache_entry_is_published_whole_with_its_meta(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "entry"
    write_atomically(entry, three_samples().save, {"source": "x", "samples": 3})
    assert sorted(p.name for p in entry.iterdir()) == [
        "first_targets.npy",
        "lengths.npy",
        "meta.json",
        "targets.bin",
        "tokens.bin",
    ]
    assert json.loads((entry / "meta.json").read_text()) == {"source": "x", "samples": 3}
    assert [p.name for p in entry.parent.iterdir()] == ["entry"]  # no staging directory left behind
    # Another process published the same entry first: nothing to do, no error.
    write_atomically(entry, three_samples().save, {"source": "x", "samples": 3})

    def fail(directory: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(
        LitsftError, match="cannot write the data cache to .*No space left on device.*cache_dir"
    ):
        write_atomically(tmp_path / "cache" / "other", fail, {})
    assert [p.name for p in entry.parent.iterdir()] == ["entry"]


def test_a_preparation_removes_what_dead_preparations_left_and_keeps_live_ones(tmp_path: Path) -> None:
    """Staging folders are named by their writer: a later preparation removes those of writers that are
    gone (a dead pid, a reused pid) and of unchanged ones it cannot check (another host, an unnamed writer)
    after FOREIGN_LEFTOVER_AFTER_S, and keeps those of a live process and recent ones from another host."""
    cache = tmp_path / "cache"
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    live_start = process_start_time(live.pid)
    folders = {
        "dead": f".a.tmp-{host}.{dead.pid}.{live_start}",
        "reused": f".b.tmp-{host}.{live.pid}.{live_start - 1}",  # the pid now belongs to a later process
        "live": f".c.tmp-{host}.{live.pid}.{live_start}",
        "other host, recent": ".d.tmp-elsewhere.1.1",
        "other host, old": ".e.tmp-elsewhere.1.1",
        "unnamed, old": ".f.tmp-1a2b3c4d",
    }
    for name in folders.values():
        (cache / name).mkdir(parents=True)
        (cache / name / "tokens.bin").write_bytes(b"x" * 1000)
    an_hour_ago = time.time() - samples_module.FOREIGN_LEFTOVER_AFTER_S - 60
    for key in ("other host, old", "unnamed, old"):
        for path in (cache / folders[key] / "tokens.bin", cache / folders[key]):
            os.utime(path, (an_hour_ago, an_hour_ago))
    try:
        write_atomically(cache / "entry", three_samples().save, {"source": "x"})
    finally:
        live.communicate()
    left = sorted(path.name for path in cache.iterdir())
    assert left == sorted([folders["live"], folders["other host, recent"], "entry"])


class PidFormat(CountingFormat):
    """Conversation n is the sample [n, pid of the process that tokenized it], its last token a target."""

    def tokenize_many(self, conversations):
        part = super().tokenize_many(conversations)
        part.tokens[1::2] = os.getpid()
        return part


def test_tokenizing_uses_worker_processes_while_other_threads_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """A training run has threads (the launcher's, the lock's heartbeat): forking then could deadlock, so the
    workers start from a fresh server process; the samples are the same, and none is tokenized here."""
    monkeypatch.setattr(samples_module, "CHUNK_SIZE", 3)
    monkeypatch.setattr(samples_module, "tokenizing_processes", lambda count, requested: 2)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        tokenize_to_cache([[n] for n in range(10)], PidFormat(), tmp_path / "entry")
    finally:
        stop.set()
        thread.join()
    samples = Samples.load(tmp_path / "entry")
    assert [tokens[0] for tokens, _ in as_lists(samples)] == list(range(10))
    pids = {tokens[1] for tokens, _ in as_lists(samples)}
    assert os.getpid() not in pids and len(pids) >= 1


def test_tokenize_processes_sets_how_many_processes_tokenize(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """--data.tokenize_processes: 1 tokenizes here, 2 in workers; never more processes than chunks."""
    assert samples_module.tokenizing_processes(25_000, requested=8) == 3
    assert samples_module.tokenizing_processes(25_000, requested=2) == 2
    monkeypatch.setattr(samples_module, "CHUNK_SIZE", 3)
    for processes in (1, 2):
        tokenize_to_cache(
            [[n] for n in range(10)], PidFormat(), tmp_path / str(processes), processes=processes
        )
        pids = {tokens[1] for tokens, _ in as_lists(Samples.load(tmp_path / str(processes)))}
        assert (pids == {os.getpid()}) == (processes == 1), pids


def test_workers_replaced_after_their_chunks_write_the_same_cache_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """A worker tokenizes CHUNKS_PER_WORKER chunks, then a fresh one takes its place (what it read of a
    memory-mapped dataset leaves with it): the files are those one process writes, byte for byte."""
    # CHUNK_SIZE as it is: a worker started from the server process (when an earlier test left a thread
    # running) does not see this process's monkeypatches. CHUNKS_PER_WORKER is read here, by the pool.
    monkeypatch.setattr(samples_module, "CHUNKS_PER_WORKER", 2)
    conversations = [[n] for n in range(6 * samples_module.CHUNK_SIZE + 5)]  # 7 chunks
    for processes in (1, 2):
        tokenize_to_cache(conversations, CountingFormat(), tmp_path / str(processes), processes=processes)
    names = ["first_targets.npy", "lengths.npy", "targets.bin", "tokens.bin"]
    assert sorted(path.name for path in (tmp_path / "2").iterdir()) == names
    for name in names:
        assert (tmp_path / "2" / name).read_bytes() == (tmp_path / "1" / name).read_bytes(), name
    tokenize_to_cache(conversations, PidFormat(), tmp_path / "pids", processes=2)
    pids = [tokens[1] for tokens, _ in as_lists(Samples.load(tmp_path / "pids"))]
    chunks_per_pid = {pid: pids.count(pid) / samples_module.CHUNK_SIZE for pid in set(pids)}
    assert os.getpid() not in chunks_per_pid and len(chunks_per_pid) >= 4, chunks_per_pid
    assert max(chunks_per_pid.values()) <= 2, chunks_per_pid


KEPT_BY_WORKER: list[np.ndarray] = []
"""What `HeapFormat` keeps alive in the process it runs in, above the blocks it freed (as a tokenizer's
caches do): the heap cannot shrink from its top past it."""


def anonymous_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


class HeapFormat(CountingFormat):
    """Conversation n is the sample [anonymous MB of the tokenizing process when its chunk began, its pid];
    each chunk frees 36 MB of heap below a block it keeps, as rendering and tokenizing a chunk leave it."""

    def tokenize_many(self, conversations):
        anonymous = anonymous_mb()
        large = np.ones(30 << 20, np.uint8)
        del large  # frees a mapping: glibc's mmap threshold rises to 30 MB, and what follows is heap
        arrays = [np.ones(4 << 20, np.uint8) for _ in range(10)]
        KEPT_BY_WORKER.append(arrays.pop())
        del arrays
        part = super().tokenize_many(conversations)
        part.tokens[0::2], part.tokens[1::2] = round(anonymous), os.getpid()
        return part


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim"
)
@pytest.mark.parametrize("processes", [1, 2])
def test_tokenizing_hands_back_the_heap_a_chunk_freed_before_the_next(processes: int, tmp_path: Path) -> None:
    """What a chunk's rows and Python objects freed stays resident in a process unless handed back: the
    anonymous memory of the process that tokenizes (this one, or each worker) when its next chunk begins is
    within the 4 MB a chunk keeps of what it was at its first."""
    chunk = samples_module.CHUNK_SIZE  # as it is: a worker from the server process would not see a patch
    tokenize_to_cache([[n] for n in range(6 * chunk)], HeapFormat(), tmp_path / "entry", processes=processes)
    samples = as_lists(Samples.load(tmp_path / "entry"))
    at_chunk_start: dict[int, list[int]] = {}
    for first in range(0, len(samples), chunk):
        anonymous, pid = samples[first][0]
        at_chunk_start.setdefault(pid, []).append(anonymous)
    # Beyond the 4 MB each earlier chunk of the process keeps: 40 MB and more when nothing is handed back.
    grown = [
        later - starts[0] - 4 * chunks_before
        for starts in at_chunk_start.values()
        for chunks_before, later in enumerate(starts[1:], start=1)
    ]
    assert (os.getpid() in at_chunk_start) == (processes == 1) and grown, at_chunk_start
    assert max(grown) < 12, at_chunk_start


def test_counting_an_entry_a_block_at_a_time_equals_counting_its_loaded_samples(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """count_lengths reads the per-sample files in blocks (here of 4 samples), leaving out the indices
    given: the counts are those of the loaded samples, by numpy over the whole arrays."""
    monkeypatch.setattr(samples_module, "COUNTED_BLOCK", 4)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=23)
    targets = rng.random(int(lengths.sum())) < 0.1
    Samples.back_to_back(np.arange(len(targets), dtype=np.int32), targets, lengths).save(tmp_path)
    loaded = Samples.load(tmp_path)
    for limit in (1, 5, 20, 100):
        for leave_out in (None, np.array([0, 3, 4, 11, 22]), np.arange(23)):
            kept = loaded if leave_out is None else loaded.subset(np.setdiff1d(np.arange(23), leave_out))
            counts = samples_module.count_lengths(tmp_path, limit, leave_out)
            cut = kept.lengths[kept.lengths > limit] - limit
            truncated, dropped = kept.truncate(limit)
            assert (counts.samples, counts.tokens, counts.longer) == (len(kept), kept.num_tokens, len(cut))
            assert (counts.cut_tokens, counts.most_cut) == (int(cut.sum()), int(cut.max(initial=0)))
            assert counts.without_target == dropped and counts.samples - dropped == len(truncated)
    assert samples_module.count_lengths(tmp_path, 5, np.arange(23)).samples == 0
