"""Pretraining data streamed with litdata: `--data TextFiles`, `--data LitData` and `litsft prepare`
(litsft/data/text.py, litsft/data/litdata_shards.py, litsft/data/prepare.py)."""

from __future__ import annotations

import pytest
import torch

from litsft.data import LitData, TextFiles, build_demo_tokenizer, write_demo_corpus
from litsft.data.litdata_shards import byte_ranges, tokenize_piece
from litsft.data.prepare import prepare
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError


@pytest.fixture(autouse=True)
def litdata_in_tmp(tmp_path, monkeypatch):
    for name in ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER", "TMPDIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
        (tmp_path / name.lower()).mkdir()


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo-tokenizer")
    build_demo_tokenizer(directory)
    return directory


def connected(data, checkpoint_dir, max_seq_length=16):
    data.connect(Tokenizer(checkpoint_dir), max_seq_length, seed=0)
    return data


@pytest.mark.parametrize("num_workers", [0, 2])
def test_text_files_stream_and_resume(tmp_path, checkpoint_dir, num_workers):
    write_demo_corpus(tmp_path / "corpus", num_examples=400, num_files=4)
    data = connected(
        TextFiles(train_data_path=tmp_path / "corpus", cache_dir=tmp_path / "cache", num_workers=num_workers),
        checkpoint_dir,
    )
    data.prepare()
    data.setup()
    assert {split: len(files) for split, files in data.splits().items()} == {"train": 3, "val": 1}
    loader = data.train_dataloader(rank=0, world_size=1, micro_batch_size=2, global_batch_size=4)
    iterator = iter(loader)
    first = next(iterator)
    assert first["input_ids"].shape == (2, 16) and torch.equal(
        first["labels"][:, :-1], first["input_ids"][:, 1:]
    )
    assert first["position_ids"][1].tolist() == list(range(16))
    next(iterator)
    state = loader.state_dict()
    expected = next(iterator)
    resumed = data.train_dataloader(rank=0, world_size=1, micro_batch_size=2, global_batch_size=4)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], expected["input_ids"])
    assert len(data.val_dataloader(0, 1, 2)) > 0


def test_two_ranks_stream_disjoint_blocks(tmp_path, checkpoint_dir):
    write_demo_corpus(tmp_path / "corpus", num_examples=200, num_files=2)
    data = connected(
        TextFiles(train_data_path=tmp_path / "corpus", cache_dir=tmp_path, val_split_fraction=0),
        checkpoint_dir,
    )
    data.prepare()
    blocks = []
    for rank in range(2):
        loader = data.train_dataloader(rank, 2, 2, 4)
        blocks.append({tuple(row.tolist()) for batch in loader for row in batch["input_ids"]})
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
    assert len(data.train_dataloader(0, 2, 2, 4)) == len(data.train_dataloader(1, 2, 2, 4))


def test_each_file_is_one_document(tmp_path, checkpoint_dir):
    text = "Add the numbers.\n1 + 2\n3\n" * 50
    (tmp_path / "a.txt").write_text(text)
    pieces = byte_ranges([tmp_path / "a.txt"], range_bytes=100)
    assert len(pieces) > 5 and all(text.encode()[start:end].endswith(b"\n") for _, start, end, _ in pieces)
    tokens = torch.cat([tokenize_piece(piece, str(checkpoint_dir)) for piece in pieces])
    tokenizer = Tokenizer(checkpoint_dir)
    assert tokens.tolist() == tokenizer.encode(text, add_eos=True)


def test_prepare_writes_a_litdata_dataset(tmp_path, checkpoint_dir):
    write_demo_corpus(tmp_path / "corpus", num_examples=200, num_files=3)
    prepare(tmp_path / "corpus", tmp_path / "out", checkpoint_dir, val_fraction=0.3, num_workers=1)
    assert (tmp_path / "out" / "train" / "index.json").is_file() and (
        tmp_path / "out" / "val" / "index.json"
    ).is_file()
    data = connected(LitData(path=str(tmp_path / "out")), checkpoint_dir)
    batch = next(iter(data.train_dataloader(0, 1, 2, 2)))
    assert batch["input_ids"].shape == (2, 16)
    assert data.val_dataloader(0, 1, 2) is not None
    with pytest.raises(LitsftError) as error:
        prepare(tmp_path / "corpus", tmp_path / "out", checkpoint_dir)
    assert (
        str(error.value) == f"{tmp_path / 'out'} exists and is not empty; choose a new --out_dir or delete it"
    )


def test_bad_text_files_fail_before_anything_is_written(tmp_path, checkpoint_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("fine\n")
    (corpus / "b.txt").write_bytes(b"fine\nnot \xff fine\n")
    data = connected(TextFiles(train_data_path=corpus, cache_dir=tmp_path / "cache"), checkpoint_dir)
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert (
        str(error.value)
        == f"{corpus / 'b.txt'} line 2: byte 0xff is not valid UTF-8; re-encode the file as UTF-8"
    )
    (corpus / "b.txt").write_text("\n\n")
    with pytest.raises(LitsftError) as error:
        data.prepare()
    assert str(error.value) == f"{corpus / 'b.txt'} is empty; remove it or add text"
    assert not (tmp_path / "cache").exists()
    with pytest.raises(LitsftError) as error:
        prepare(corpus, tmp_path / "out", checkpoint_dir)
    assert not (tmp_path / "out").exists()


def test_lit_data_paths(tmp_path, checkpoint_dir):
    data = connected(LitData(path=str(tmp_path / "missing")), checkpoint_dir)
    with pytest.raises(LitsftError) as error:
        data.train_dataloader(0, 1, 1, 1)
    assert (
        str(error.value)
        == f"--data.path {tmp_path / 'missing'} does not exist; create it with `litsft prepare`"
    )
    (tmp_path / "empty").mkdir()
    data = connected(LitData(path=str(tmp_path / "empty")), checkpoint_dir)
    with pytest.raises(LitsftError, match="holds no litdata dataset"):
        data.train_dataloader(0, 1, 1, 1)


def test_text_files_epochs(tmp_path, checkpoint_dir):
    write_demo_corpus(tmp_path / "corpus", num_examples=100, num_files=2)
    data = connected(
        TextFiles(train_data_path=tmp_path / "corpus", cache_dir=tmp_path, val_split_fraction=0),
        checkpoint_dir,
    )
    data.prepare()
    loader = data.train_dataloader(0, 1, 2, 2)
    first = [batch["input_ids"] for batch in loader]
    loader.set_epoch(1)
    second = [batch["input_ids"] for batch in loader]
    assert len(first) == len(second) == len(loader) > 0
    assert not all(torch.equal(a, b) for a, b in zip(first, second))  # reshuffled
    assert sorted(map(tuple, torch.cat(first).tolist())) == sorted(map(tuple, torch.cat(second).tolist()))


def test_tokenizing_says_one_line_and_nothing_else(tmp_path, checkpoint_dir, capfd):
    """litdata's own output (an advertisement, lines from every worker) is left out: one line says what runs."""
    write_demo_corpus(tmp_path / "corpus", num_examples=100, num_files=2)
    data = connected(
        TextFiles(train_data_path=tmp_path / "corpus", cache_dir=tmp_path / "cache", val_split_fraction=0,
                  tokenize_workers=1),
        checkpoint_dir,
    )  # fmt: skip
    capfd.readouterr()
    data.prepare()
    out, err = capfd.readouterr()
    files = data.splits()["train"]
    assert out.splitlines() == [
        f"Tokenizing 2 text files into {data.optimized_dir('train', files)} with 1 process"
    ]
    assert err == ""
