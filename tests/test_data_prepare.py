"""litsft/data/prepare.py (`litsft prepare`): which files become the training and the validation split, what
is refused before anything is tokenized, and the line it ends with. The tokenizing itself is stood in for
here (tests/test_data_litdata_shards.py tests it); a real `prepare` read back by `--data LitData` is in
tests/test_data_text.py. `litsft prepare_sft` is run in this process on a real chat template (Qwen2.5's), its
samples compared with transformers' render."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tiny_tokenizer import write_tiny_tokenizer

import litsft.data.prepare as prepare_module
from litsft.data.prepare import prepare
from litsft.errors import LitsftError


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The split each optimize_text call would write, by its directory name, with the names of its files."""
    splits: dict[str, list[str]] = {}

    def record(files, out_dir, checkpoint_dir, num_workers, chunk_bytes) -> None:
        splits[Path(out_dir).name] = [Path(f).name for f in files]

    monkeypatch.setattr(prepare_module, "optimize_text", record)
    return splits


def corpus(directory: Path, count: int) -> Path:
    directory.mkdir(parents=True)
    for i in range(count):
        (directory / f"{i:02d}.txt").write_text(f"text {i}\n")
    (directory / "notes.md").write_text("not a text file\n")
    return directory


@pytest.mark.parametrize(
    ("count", "val_fraction", "val_files"),
    [(10, 0.2, ["08.txt", "09.txt"]), (10, 0.01, ["09.txt"]), (10, 0.0, []), (1, 0.5, [])],
)
def test_the_last_files_of_the_sorted_list_are_held_out(
    tmp_path, tokenizer_dir, written, capsys, count, val_fraction, val_files
) -> None:
    prepare(corpus(tmp_path / "corpus", count), tmp_path / "out", tokenizer_dir, val_fraction=val_fraction)
    train = [f"{i:02d}.txt" for i in range(count) if f"{i:02d}.txt" not in val_files]
    assert written == ({"train": train, "val": val_files} if val_files else {"train": train})
    assert capsys.readouterr().out == (
        f"wrote {tmp_path / 'out'}: {len(train)} training and {len(val_files)} validation files\n"
    )


@pytest.mark.parametrize("val_fraction", [1.0, -0.1])
def test_a_validation_share_outside_0_to_1_is_refused(tmp_path, tokenizer_dir, written, val_fraction) -> None:
    with pytest.raises(LitsftError) as error:
        prepare(corpus(tmp_path / "corpus", 3), tmp_path / "out", tokenizer_dir, val_fraction=val_fraction)
    assert str(error.value) == f"val_fraction={val_fraction} must be in [0, 1)"
    assert written == {} and not (tmp_path / "out").exists()


def test_a_non_empty_out_dir_is_refused_and_an_empty_one_used(tmp_path, tokenizer_dir, written) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(LitsftError) as error:
        prepare(corpus(tmp_path / "corpus", 3), tmp_path / "out", tokenizer_dir)
    assert (
        str(error.value) == f"{tmp_path / 'out'} exists and is not empty; choose a new --out_dir or delete it"
    )
    assert written == {} and (tmp_path / "out" / "mine.txt").read_text() == "keep"
    (tmp_path / "out" / "mine.txt").unlink()
    prepare(tmp_path / "corpus", tmp_path / "out", tokenizer_dir)
    assert written == {"train": ["00.txt", "01.txt"], "val": ["02.txt"]}


def test_bad_text_is_refused_before_anything_is_tokenized(tmp_path, tokenizer_dir, written) -> None:
    directory = corpus(tmp_path / "corpus", 3)
    (directory / "01.txt").write_bytes(b"fine\n\xff\n")
    with pytest.raises(LitsftError, match=r"01.txt line 2: byte 0xff is not valid UTF-8"):
        prepare(directory, tmp_path / "out", tokenizer_dir)
    (tmp_path / "no-text").mkdir()
    with pytest.raises(LitsftError, match=r"holds no .txt files"):
        prepare(tmp_path / "no-text", tmp_path / "out", tokenizer_dir)
    assert written == {} and not (tmp_path / "out").exists()


def test_text_files_are_found_in_subdirectories_and_one_file_is_all_training(
    tmp_path, tokenizer_dir, written
) -> None:
    (tmp_path / "corpus" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "corpus" / "deep" / "er" / "a.txt").write_text("a\n")
    prepare(tmp_path / "corpus", tmp_path / "out", tokenizer_dir, val_fraction=0.5)
    assert written == {"train": ["a.txt"]}


# ---- prepare_sft ----------------------------------------------------------------------------------------
QWEN_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2.5.jinja"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8."},
    ],
]


def test_prepare_sft_caches_what_training_reads_and_shows_samples_with_the_loss_tokens_marked(
    tmp_path, capsys
) -> None:
    """With Qwen2.5's own chat template: each sample printed is transformers' render of its conversation,
    with exactly the assistant replies (each with its <|im_end|>) between the marks; then a run with the
    same data finds the cache instead of tokenizing again."""
    from transformers import AutoTokenizer

    from litsft.__main__ import main
    from litsft.data import JSON
    from litsft.data.prepare import LOSS_CLOSE, LOSS_OPEN
    from litsft.data.tokenizer import Tokenizer

    checkpoint = tmp_path / "checkpoint"
    write_tiny_tokenizer(checkpoint, chat_template="chatml")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS))
    data = ["--data", "JSON", "--data.json_path", str(tmp_path / "data.jsonl"),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.val_split_fraction", "0"]  # fmt: skip
    main(["prepare_sft", str(checkpoint), *data, "--max_seq_length", "256", "--show_samples", "5"])
    out = capsys.readouterr().out
    headers = re.findall(r"^--- training sample (\d) of 2: (\d+) tokens, (\d+) carry loss.*---$", out, re.M)
    assert [index for index, _, _ in headers] == ["1", "2"]
    shown = re.split(r"^--- training sample .*---\n", out, flags=re.M)[1:]
    hf = AutoTokenizer.from_pretrained(checkpoint)
    replies = [["Hello there."], ["It is 5.", "8."]]
    for text, conversation, expected in zip(shown, CONVERSATIONS, replies):
        assert (
            text.replace(LOSS_OPEN, "").replace(LOSS_CLOSE, "")
            == hf.apply_chat_template(conversation, tokenize=False) + "\n"
        )
        assert re.findall(f"{LOSS_OPEN}(.*?){LOSS_CLOSE}", text, re.S) == [f"{r}<|im_end|>" for r in expected]
    assert re.search(
        r"^Prepared the train data: 2 records, 2 samples, \d+ tokens, 0 longer than max_seq_length=256, 0 skipped; "
        r"tokenized in [\d.]+ s$",
        out,
        re.M,
    )
    # A training run with the same data and tokenizer reads what prepare_sft wrote.
    (entry,) = (tmp_path / "cache" / "sft").iterdir()
    written = (entry / "tokens.bin").stat().st_mtime_ns
    run = JSON(json_path=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache", val_split_fraction=0)
    run.connect(Tokenizer(checkpoint), 256, seed=0)
    run.prepare()
    assert "read from the cache" in capsys.readouterr().out
    assert (entry / "tokens.bin").stat().st_mtime_ns == written


def test_prepare_sft_refuses_no_data_pretraining_data_and_a_negative_sample_count(tmp_path) -> None:
    from litsft.data import JSON, TextFiles
    from litsft.data.prepare import prepare_sft

    with pytest.raises(
        LitsftError, match=r"^no data given; prepare_sft takes --data JSON, HFDataset or Demo"
    ):
        prepare_sft(tmp_path)
    with pytest.raises(LitsftError, match=r"^--data TextFiles is not SFT data; .*`litsft prepare` tokenizes"):
        prepare_sft(tmp_path, TextFiles(train_data_path=tmp_path))

    with pytest.raises(LitsftError, match=r"^--show_samples=-1 must be at least 0$"):
        prepare_sft(tmp_path, JSON(json_path=tmp_path / "data.jsonl"), show_samples=-1)


def test_prepare_sft_with_pairs_shows_both_halves_of_each_pair_with_their_replies_marked(
    tmp_path, capsys
) -> None:
    """--pairs reads preference records and shows each pair's chosen and rejected sample, the reply alone
    between the marks; the prepared line counts pairs."""
    from litsft.__main__ import main
    from litsft.data.prepare import LOSS_CLOSE, LOSS_OPEN

    checkpoint = tmp_path / "checkpoint"
    write_tiny_tokenizer(checkpoint, chat_template="chatml")
    pairs = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(pair) for pair in pairs))
    data = ["--data", "JSON", "--data.json_path", str(tmp_path / "pairs.jsonl"),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.val_split_fraction", "0"]  # fmt: skip
    main(["prepare_sft", str(checkpoint), *data, "--pairs", "true", "--show_samples", "2"])
    out = capsys.readouterr().out
    assert "3 records, 3 preference pairs (6 samples)" in out
    headers = re.findall(r"^--- training pair (\d) of 3, (chosen|rejected): .*---$", out, re.M)
    assert headers == [("1", "chosen"), ("1", "rejected"), ("2", "chosen"), ("2", "rejected")]
    shown = "\n".join(line for line in out.splitlines() if not line.startswith("---"))
    marked = re.findall(f"{LOSS_OPEN}(.*?){LOSS_CLOSE}", shown, re.S)
    assert marked == ["good 0<|im_end|>", "bad 0<|im_end|>", "good 1<|im_end|>", "bad 1<|im_end|>"]
