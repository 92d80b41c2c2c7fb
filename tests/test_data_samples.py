"""litsft/data/samples.py: `Samples` by value (subset, truncation against a Python loop, save and load without
pickles), and `tokenize_conversations` chunk by chunk with a stand-in chat format: the chunks joined in order,
and a conversation that cannot be tokenized named by its record wherever its chunk falls."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import litsft.data.samples as samples_module
from litsft.data.chat import ConversationError, Tokenized, TokenizeReport
from litsft.data.samples import Samples, tokenize_conversations, write_atomically
from litsft.errors import LitsftError


def three_samples() -> Samples:
    """Samples [1, 2, 3], [] and [4, 5], the last token of each a target."""
    return Samples(
        tokens=np.array([1, 2, 3, 4, 5], dtype=np.int32),
        targets=np.array([False, False, True, False, True]),
        offsets=np.array([0, 3, 3, 5], dtype=np.int64),
    )


def test_subset_gathers_the_samples_in_the_order_given() -> None:
    samples = three_samples()
    assert len(samples) == 3 and samples.lengths.tolist() == [3, 0, 2]
    picked = samples.subset(np.array([2, 1, 0]))
    assert picked.tokens.tolist() == [4, 5, 1, 2, 3]
    assert picked.targets.tolist() == [False, True, False, False, True]
    assert picked.offsets.tolist() == [0, 2, 2, 5]
    assert len(samples.subset(np.array([], dtype=np.int64))) == 0


@pytest.mark.parametrize("max_tokens", [12, 30])  # 30: no sample is longer, nothing is cut
def test_truncate_is_the_python_loop(max_tokens):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 30, 50)  # an empty sample too (lengths[7] == 0)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    samples = Samples(
        rng.integers(0, 100, offsets[-1]).astype(np.int32), rng.random(offsets[-1]) < 0.2, offsets
    )
    original_targets = samples.targets.copy()
    truncated, dropped = samples.truncate(max_tokens)
    assert np.array_equal(samples.targets, original_targets)  # the samples truncated are left as they were
    expected = []
    for i in range(50):
        tokens = samples.tokens[offsets[i] : offsets[i + 1]][:max_tokens]
        targets = samples.targets[offsets[i] : offsets[i + 1]][:max_tokens].copy()
        targets[:1] = False
        if targets.any():
            expected.append((tokens.tolist(), targets.tolist()))
    got = [
        (truncated.tokens[a:b].tolist(), truncated.targets[a:b].tolist())
        for a, b in zip(truncated.offsets[:-1], truncated.offsets[1:])
    ]
    assert got == expected and dropped == 50 - len(expected) > 0


def test_save_and_load_round_trip_and_refuse_pickles(tmp_path: Path) -> None:
    samples = three_samples()
    samples.save(tmp_path / "entry")
    loaded = Samples.load(tmp_path / "entry")
    for name in ("tokens", "targets", "offsets"):
        assert np.array_equal(getattr(loaded, name), getattr(samples, name))
        assert getattr(loaded, name).dtype == getattr(samples, name).dtype
    np.save(tmp_path / "entry" / "tokens.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle=False"):
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
    assert samples.tokens.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert samples.offsets.tolist() == [0, 2, 4, 6, 8, 10]
    assert samples.targets.tolist() == [False, True] * 5
    empty, _ = tokenize_conversations([], CountingFormat())
    assert len(empty) == 0 and empty.offsets.tolist() == [0]


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
        "meta.json",
        "offsets.npy",
        "targets.npy",
        "tokens.npy",
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
