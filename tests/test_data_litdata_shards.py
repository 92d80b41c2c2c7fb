"""litsft/data/litdata_shards.py: files cut into pieces at line ends, each file one document (bos before its
first piece, eos after its last), a tiny shard round trip through litdata (the streamed blocks are the files'
tokens in order), and the batches and state the streaming loader gives. Whole data modules on top of it are
in tests/test_data_text.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data.litdata_shards import (
    StreamingLoader,
    byte_ranges,
    optimize_text,
    streaming_loader,
    tokenize_piece,
)
from litsft.data.tokenizer import Tokenizer

TEXTS = {"a.txt": "one two three\nfour five\n" * 12, "b.txt": "six seven\n", "c.txt": "eight nine ten\n" * 5}


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    paths = []
    for name, text in TEXTS.items():
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
    return paths


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(directory, chat_template=None, add_bos=True)
    return directory


def test_pieces_end_at_line_ends_and_cover_each_file_once(corpus: list[Path]) -> None:
    pieces = byte_ranges(corpus, range_bytes=40)
    for path in corpus:
        mine = [(start, end, last) for name, start, end, last in pieces if name == str(path)]
        data = path.read_bytes()
        assert mine[0][0] == 0 and mine[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))  # back to back
        assert all(data[start:end].endswith(b"\n") for start, end, _ in mine)
        assert [last for _, _, last in mine] == [False] * (len(mine) - 1) + [True]
        assert all(end - start >= min(40, len(data)) for start, end, _ in mine[:-1])
    assert byte_ranges(corpus[1:2]) == [(str(corpus[1]), 0, len(TEXTS["b.txt"]), True)]


def test_each_file_is_one_document_bos_once_and_eos_once(corpus: list[Path], tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer(tokenizer_dir)
    assert tokenizer.add_bos
    pieces = [piece for piece in byte_ranges(corpus, range_bytes=40) if piece[0] == str(corpus[0])]
    assert len(pieces) > 2
    tokens = torch.cat([tokenize_piece(piece, str(tokenizer_dir)) for piece in pieces])
    assert tokens.dtype == torch.int32
    assert tokens.tolist() == tokenizer.encode(TEXTS["a.txt"], add_bos=True, add_eos=True)
    assert tokens.tolist().count(tokenizer.bos_id) == 1 and tokens.tolist().count(tokenizer.eos_id) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_stream_back_the_files_tokens_in_order(
    workers: int,
    corpus: list[Path],
    tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    for name in (
        "DATA_OPTIMIZER_CACHE_FOLDER",
        "DATA_OPTIMIZER_DATA_CACHE_FOLDER",
    ):  # litdata's scratch space
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    optimize_text(corpus, tmp_path / "shards", tokenizer_dir, num_workers=workers)
    processes = "1 process" if workers == 1 else f"{workers} processes"
    assert capsys.readouterr().out == f"Tokenizing 3 text files into {tmp_path / 'shards'} with {processes}\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shards")]  # staging renamed away
    tokenizer = Tokenizer(tokenizer_dir)
    documents = [tokenizer.encode(text, add_bos=True, add_eos=True) for text in TEXTS.values()]
    # Blocks never straddle two chunks (litdata drops a chunk's last partial block), so the stream is each
    # chunk's whole blocks; a chunk holds the next chunk_size files, in order, whichever worker wrote it.
    expected = []
    for chunk in json.loads((tmp_path / "shards" / "index.json").read_text())["chunks"]:
        tokens = [t for document in documents[: chunk["chunk_size"]] for t in document]
        documents = documents[chunk["chunk_size"] :]
        expected += tokens[: len(tokens) // 8 * 8]
    assert not documents
    loader = streaming_loader(str(tmp_path / "shards"), 7, 0, 1, 2, seed=0, num_workers=0, shuffle=False)
    streamed = []
    for batch in loader:
        assert batch["input_ids"].shape == (2, 7) and batch["input_ids"].dtype == torch.long
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
        assert batch["position_ids"].tolist() == [list(range(7))] * 2
        for inputs, labels in zip(batch["input_ids"], batch["labels"]):
            streamed += [*inputs.tolist(), labels[-1].item()]  # a block of 8 tokens
    assert len(loader) == len(expected) // 16 > 0
    assert streamed == expected[: len(streamed)] and len(streamed) == 16 * len(loader)


class ListLoader:
    """Stands in for litdata's StreamingDataLoader: token blocks (B, T + 1) and a state."""

    def __init__(self, blocks: list[torch.Tensor]) -> None:
        self.blocks, self.state = blocks, {"consumed": 0}

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_the_streaming_loader_shifts_labels_and_carries_its_state() -> None:
    loader = StreamingLoader(ListLoader([torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)]))
    (batch,) = list(loader)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 6, 7]] and batch["input_ids"].dtype == torch.long
    assert batch["labels"].tolist() == [[2, 3, 4], [6, 7, 8]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert len(loader) == 1
    loader.set_epoch(3)
    loader.dataloader.state = {"consumed": 5}
    state = loader.state_dict()
    assert state == {"epoch": 3, "streaming": {"consumed": 5}}
    resumed = StreamingLoader(ListLoader([]))
    resumed.load_state_dict(state)
    assert resumed.epoch == 3 and resumed.dataloader.state == {"consumed": 5}
