"""Reading .json / .jsonl record files (litsft/data/json_files.py)."""

from __future__ import annotations

import json
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from litsft.data import JSON, json_data, json_files, samples
from litsft.data.json_files import Conversations, read_conversations
from litsft.data.records import to_conversation
from litsft.data.tokenizer import Tokenizer

GOOD = {"instruction": "Add.", "input": "1 + 2", "output": "3"}


def test_json_and_jsonl_hold_the_same_records(tmp_path):
    records = [
        GOOD,
        {"instruction": "Hi", "output": "Hello", "system": "Be nice."},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    conversations = list(read_conversations(tmp_path / "a.json"))
    assert conversations == list(read_conversations(tmp_path / "a.jsonl"))
    assert conversations == [
        [{"role": "user", "content": "Add.\n\n1 + 2"}, {"role": "assistant", "content": "3"}],
        [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]


# One record of every shape, the tool-using and reasoning fields included, and one the chat template cannot
# take (a tool call whose arguments are not JSON: skipped, and named by its file and line in the cache's meta).
SHAPES = [
    {"instruction": "Add.", "input": "1 + 2", "output": "3", "system": "Be brief."},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    {"messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
                  {"role": "tool", "name": "get", "content": "sunny"},
                  {"role": "assistant", "content": "Sunny.", "reasoning_content": "the tool said so"}],
     "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]},
    {"prompt": "Name a colour.", "completion": "Blue"},
    {"prompt": [{"role": "user", "content": "Two?"}], "completion": [{"role": "assistant", "content": "2"}]},
    {"text": "Plain text, every token trained on."},
    {"messages": [{"role": "user", "content": "Call it."},
                  {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
]  # fmt: skip


def write_records(path: Path, records: list[dict]) -> list[int]:
    """`records` as JSON Lines (a blank line now and then, one non-ASCII character per record) or as one
    indented JSON list, as FastChat writes ShareGPT files; the line each record starts on."""
    lines, text = [], ""
    for index, record in enumerate(records):
        record = {**record, "id": f"№{index}"}
        if path.suffix == ".jsonl":
            text += "\n" * (index % 7 == 3)
            lines.append(text.count("\n") + 1)
            text += json.dumps(record, ensure_ascii=index % 2 == 0) + "\n"
        else:
            text += "[\n" if index == 0 else ",\n"
            lines.append(text.count("\n") + 1)
            text += textwrap.indent(json.dumps(record, indent=2, ensure_ascii=False), "  ")
    path.write_text(text + ("\n]\n" if path.suffix == ".json" else ""), encoding="utf-8")
    return lines


def prepare(tokenizer: Tokenizer, cache: Path, **options: object) -> JSON:
    data = JSON(cache_dir=cache, **options)
    data.connect(tokenizer, 64, seed=0)
    data.prepare()
    data.setup()
    return data


@pytest.mark.parametrize(
    ("layout", "suffix"),
    [("file", ".jsonl"), ("file", ".json"), ("folder", ".json"), ("folder", ".jsonl")],
)  # fmt: skip
def test_the_cache_is_byte_for_byte_what_reading_the_whole_file_first_writes(
    tmp_path: Path,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
    suffix: str,
) -> None:
    """Read a chunk at a time (here of 64 records, on two processes: 5 chunks), every
    record shape gives the cache entry, the records named in its meta and the validation split that the
    conversations of the whole file held in memory give (the reading before this module read a slice)."""
    monkeypatch.setattr(samples, "CHUNK_SIZE", 64)
    monkeypatch.setattr(json_files, "READ_BLOCK_BYTES", 4096)  # many blocks, records across their ends
    count = 300
    records = [SHAPES[index % len(SHAPES)] for index in range(count)]
    folder = tmp_path / "data"
    folder.mkdir()
    if layout == "file":
        files = {"train": folder / f"data{suffix}"}
        options = {"json_path": files["train"], "val_split_fraction": 0.1}
    else:
        files = {"train": folder / f"train{suffix}", "val": folder / f"val{suffix}"}
        options = {"json_path": folder}
    whole = {}
    for split, path in files.items():
        part = records if split == "train" else records[: count // 10]
        lines = write_records(path, part)
        whole[path] = Conversations(
            [to_conversation(r, f"{path} line {n}") for r, n in zip(part, lines)],
            path,
            lines,
        )  # fmt: skip
    streamed = prepare(tokenizer, tmp_path / "streamed", tokenize_processes=2, **options)
    monkeypatch.setattr(json_data, "read_conversations", lambda path, record_format, limit=None: whole[path])
    held = prepare(tokenizer, tmp_path / "held", tokenize_processes=2, **options)
    entries = sorted((tmp_path / "held" / "sft").iterdir())
    assert len(entries) == len(files)
    for entry in entries:
        names = sorted(file.name for file in entry.iterdir())
        assert names == ["first_targets.npy", "lengths.npy", "meta.json", "targets.bin", "tokens.bin"]
        for name in names:
            assert (tmp_path / "streamed" / "sft" / entry.name / name).read_bytes() == (
                entry / name
            ).read_bytes()
    meta = json.loads((entries[0] / "meta.json").read_text())
    assert meta["left_out"]["skipped"] > 0 and " line " in meta["left_out"]["reasons"][0]
    for split in ("train_samples", "val_samples"):
        ours, theirs = getattr(streamed, split), getattr(held, split)
        assert np.array_equal(ours.lengths, theirs.lengths) and np.array_equal(ours.starts, theirs.starts)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_reading_a_file_holds_one_chunk_of_records_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """Checking every record, then reading the file chunk by chunk as tokenizing does, the Python objects
    held peak at a few chunks' worth, not at the file's 40 chunks (the whole file was read and held)."""
    monkeypatch.setattr(samples, "CHUNK_SIZE", 100)
    monkeypatch.setattr(json_files, "READ_BLOCK_BYTES", 8192, raising=False)  # (raising: none before)
    path = tmp_path / f"data{suffix}"
    write_records(path, [SHAPES[index % 3] for index in range(4000)])
    first = read_conversations(path, limit=100)
    read_conversations(path)  # once before measuring: what its first run imports (the progress bar) stays
    tracemalloc.start()
    try:
        one_chunk = read_conversations(path, limit=100)
        chunk_bytes = tracemalloc.get_traced_memory()[0]
        del one_chunk
        tracemalloc.reset_peak()
        conversations, read = read_conversations(path), 0
        for start in range(0, len(conversations), 100):
            chunk = conversations[start : start + 100]  # as a tokenizing worker reads it
            assert chunk == list(first) if start == 0 else len(chunk) == 100
            read += len(chunk)
            del chunk
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read == 4000
    assert peak < 3 * chunk_bytes, (peak, chunk_bytes)


def test_checking_a_file_shows_a_progress_bar_in_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pass that checks every record before tokenizing says how far it is through the file (it took
    minutes without a word for large files); as the tokenizing bar, only once it has taken PROGRESS_DELAY_S."""
    path = tmp_path / "data.jsonl"
    write_records(path, SHAPES * 10)
    monkeypatch.setattr(samples, "PROGRESS_DELAY_S", 0.0)
    assert len(read_conversations(path)) == 70
    err = capsys.readouterr().err
    assert "Reading data.jsonl: 100%" in err and "B/s" in err, err
    monkeypatch.setattr(samples, "PROGRESS_DELAY_S", 60.0)
    read_conversations(path)
    assert capsys.readouterr().err == ""
