"""`--data JSON` end to end: the cache, the validation split, truncation (litsft/data/json_data.py,
litsft/data/base.py, litsft/data/samples.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data import JSON
from litsft.data.loader import IGNORE_INDEX
from litsft.data.records import to_conversation
from litsft.data.tokenizer import Tokenizer
from litsft.errors import LitsftError


def write_records(path, count, output_words=3):
    records = [
        {"instruction": f"Count to {i}", "output": " ".join(["one"] * (1 + i % output_words))}
        for i in range(count)
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


def prepared(tokenizer, max_seq_length=64, seed=0, **options) -> JSON:
    data = JSON(**options)
    data.connect(tokenizer, max_seq_length, seed)
    data.prepare()
    data.setup()
    return data


def test_file_is_split_cached_and_batched(tmp_path, tokenizer):
    write_records(tmp_path / "data.jsonl", 40)
    data = prepared(
        tokenizer, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache", val_split_fraction=0.1
    )
    assert (len(data.train_samples), len(data.val_samples)) == (36, 4)
    (entry,) = (tmp_path / "cache" / "sft").iterdir()
    assert json.loads((entry / "meta.json").read_text())["samples"] == 40
    written = (entry / "tokens.bin").stat().st_mtime_ns
    again = prepared(
        tokenizer, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache", val_split_fraction=0.1
    )
    assert (entry / "tokens.bin").stat().st_mtime_ns == written  # reused, not rewritten
    assert np.array_equal(again.train_samples.tokens, data.train_samples.tokens)

    batch = next(iter(data.train_dataloader(0, 1, 2, 4)))
    assert set(batch) == {
        "input_ids",
        "labels",
        "position_ids",
        "document_ids",
        "cu_seqlens",
        "max_seqlen",
        "row_lengths",
    }
    rows = ("input_ids", "labels", "position_ids", "document_ids")
    assert all(batch[name].dtype == torch.long and batch[name].shape == (2, 64) for name in rows)
    val_rows = [row for rows in data.val_dataloader(0, 1, 2).micro_batches() for row in rows]
    assert sorted(i for row in val_rows for i in row) == [0, 1, 2, 3]

    write_records(tmp_path / "data.jsonl", 41)  # new contents, new cache entry
    prepared(tokenizer, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "sft").iterdir())) == 2


def test_train_and_val_files(tmp_path, tokenizer):
    write_records(tmp_path / "train.jsonl", 10)
    (tmp_path / "val.json").write_text(json.dumps([{"instruction": "a", "output": "b"}] * 3))
    data = prepared(tokenizer, json_path=tmp_path, cache_dir=tmp_path / "cache")
    assert (len(data.train_samples), len(data.val_samples)) == (10, 3)
    (tmp_path / "train.json").write_text("[]")
    with pytest.raises(LitsftError) as error:
        prepared(tokenizer, json_path=tmp_path, cache_dir=tmp_path / "cache")
    assert str(error.value) == f"{tmp_path} has both train.json and train.jsonl; keep one of them"


def test_truncation_keeps_the_mask_and_drops_samples_without_targets(tmp_path, tokenizer, capsys):
    long_prompt = {"instruction": "word " * 80, "output": "ok"}
    records = [
        {"instruction": "Hi", "output": "Hello there " * 20},
        long_prompt,
        {"instruction": "a", "output": "b"},
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    data = prepared(
        tokenizer,
        max_seq_length=48,
        json_path=tmp_path / "data.jsonl",
        cache_dir=tmp_path,
        val_split_fraction=0,
    )
    assert re.sub(r"tokenized in [\d.]+ s", "tokenized in X s", capsys.readouterr().out) == (
        "Truncated 2 of 3 training samples to max_seq_length=48: 317 tokens cut from their ends (at most 239 "
        "from one, 158 on average); raise --train.max_seq_length to train on them whole\n"
        "Dropped 1 of 3 training samples: no assistant token is left within max_seq_length=48; "
        "raise max_seq_length or shorten the prompts\n"
        "Prepared the train data: 3 records, 3 samples, 462 tokens, 2 longer than max_seq_length=48, 0 skipped; "
        "tokenized in X s\n"
    )
    assert data.val_samples is None and data.val_dataloader(0, 1, 1) is None
    assert data.train_samples.lengths.tolist()[0] == 49  # cut to max_seq_length + 1 tokens
    full = data.chat_format.tokenize(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there " * 20}]
    )
    first_tokens, first_targets = data.train_samples.sample(0)
    assert np.array_equal(first_tokens, full[0][:49]) and np.array_equal(first_targets, full[1][:49])


def test_training_on_everything_labels_the_prompt(tmp_path, tokenizer):
    write_records(tmp_path / "data.jsonl", 4)
    masked = prepared(tokenizer, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path, val_split_fraction=0)
    unmasked = prepared(
        tokenizer,
        json_path=tmp_path / "data.jsonl",
        cache_dir=tmp_path,
        val_split_fraction=0,
        mask_prompt=False,
    )
    batch = next(iter(unmasked.train_dataloader(0, 1, 4, 4)))
    in_document = batch["document_ids"] >= 0
    assert (batch["labels"][in_document] != IGNORE_INDEX).all()
    masked_batch = next(iter(masked.train_dataloader(0, 1, 4, 4)))
    assert (masked_batch["labels"] != IGNORE_INDEX).sum() < (batch["labels"] != IGNORE_INDEX).sum()


def test_too_little_data_for_one_global_batch(tmp_path, tokenizer):
    write_records(tmp_path / "data.jsonl", 3)
    data = prepared(
        tokenizer, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path, val_split_fraction=0, packing=False
    )
    with pytest.raises(LitsftError) as error:
        data.train_dataloader(0, 1, 4, 4)
    assert str(error.value) == (
        "there are 3 training samples, fewer than global_batch_size=4; lower global_batch_size or add data"
    )
    # Packed, 8 short samples share rows of 256 tokens: the message says how many rows they make.
    write_records(tmp_path / "data.jsonl", 8)
    data = prepared(
        tokenizer, 256, json_path=tmp_path / "data.jsonl", cache_dir=tmp_path, val_split_fraction=0
    )
    with pytest.raises(LitsftError) as error:
        data.train_dataloader(0, 1, 8, 8)
    rows = sum(1 for batch in data._loader(data.train_samples, 0, 1, 1, 1).global_batches() for _ in batch)
    assert str(error.value) == (
        f"the 8 training samples fill {rows} packed rows, fewer than global_batch_size=8; lower "
        "global_batch_size or add data"
    )
    assert 1 < rows < 8


# Marks the last message with its own header (so no render is a prefix of a longer one, turn by turn
# either) and writes "cat" as "dog": a reply holding "cat" cannot be found for the loss mask.
UNMASKABLE_TEMPLATE = (
    "{% for m in messages %}{% set head = 'final' if loop.last else m['role'] %}"
    "{{ '<|im_start|>' + head + '\\n' + m['content'].replace('cat', 'dog') + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>final\\n' }}{% endif %}"
)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_record_the_template_cannot_mask_is_named_by_file_and_line(tmp_path, suffix):
    write_tiny_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text(UNMASKABLE_TEMPLATE)
    records = [{"instruction": "a", "output": "one"}, {"instruction": "b", "output": "two"},
               {"instruction": "c", "output": "the cat"}, {"instruction": "d", "output": "four"}]  # fmt: skip
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(record) for record in records))
    else:  # one key per line: the third record starts on line 10
        path.write_text(json.dumps(records, indent=2))
    line = 3 if suffix == ".jsonl" else 10
    with pytest.raises(LitsftError) as error:
        prepared(
            Tokenizer(tmp_path / "tokenizer"),
            json_path=path,
            cache_dir=tmp_path / "cache",
            skip_invalid=False,
        )
    assert str(error.value) == (
        f"{path} line {line} (record 3): the checkpoint chat template does not show assistant message 1 "
        "verbatim, so its tokens cannot be found for the loss mask; choose a --data.prompt_style such as chatml"
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("meta.json"))


def test_multi_turn_reasoning_records_train_one_sample_per_reply(tmp_path):
    from test_data_chat import REASONING_CONVERSATION, REASONING_TEMPLATE

    write_tiny_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "chat_template.jinja").write_text(REASONING_TEMPLATE)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"messages": REASONING_CONVERSATION}) for _ in range(3)))
    tokenizer = Tokenizer(tmp_path / "tokenizer")
    data = prepared(tokenizer, max_seq_length=256, json_path=path, cache_dir=tmp_path / "cache",
                    val_split_fraction=0)  # fmt: skip
    assert len(data.train_samples) == 6
    first_turn, _ = data.chat_format.tokenize(REASONING_CONVERSATION[:2])
    assert data.train_samples.sample(0)[0].tolist() == first_turn.tolist()
    batch = next(iter(data.train_dataloader(rank=0, world_size=1, micro_batch_size=1, global_batch_size=1)))
    assert (batch["labels"] != IGNORE_INDEX).any()


@pytest.mark.parametrize("mask_prompt", [True, False])
@pytest.mark.parametrize("layout", ["held-out", "val-file"])
def test_validation_prompts_are_the_first_validation_conversations_up_to_their_reply(
    tmp_path, tokenizer, mask_prompt, layout
):
    """What the sample at each validation is generated from: the prompt of each of the first validation
    conversations, rendered with the chat template up to the assistant header, as in training."""
    records = [{"instruction": f"Count to {i}", "output": "one " * (1 + i % 3)} for i in range(20)]
    if layout == "val-file":
        (tmp_path / "train.json").write_text(json.dumps(records[:12]))
        (tmp_path / "val.json").write_text(json.dumps(records[12:]))
        options = {"json_path": tmp_path}
    else:
        (tmp_path / "data.json").write_text(json.dumps(records))
        options = {"json_path": tmp_path / "data.json", "val_split_fraction": 0.2}
    data = prepared(tokenizer, cache_dir=tmp_path / "cache", mask_prompt=mask_prompt, **options)
    conversations = [to_conversation(record) for record in records]
    # Which records were held out, found by their tokens in the validation samples.
    tokens_of = [tuple(data.chat_format.tokenize(c)[0].tolist()) for c in conversations]
    first_val = [
        conversations[tokens_of.index(tuple(data.val_samples.sample(i)[0].tolist()))] for i in range(2)
    ]
    prompts = data.validation_prompts(2)
    assert prompts == [data.chat_format.encode_prompt(c[:-1]) for c in first_val]
    assert tokenizer.decode(prompts[0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
