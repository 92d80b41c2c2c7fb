"""litsft/data/base.py: the data module interface's own parts, through `--data JSON`, the simplest module on
it: what `connect` checks and keeps, where the cache lives, the options every module checks, the held-out
validation split, the cache key's parts, and the digests behind fingerprints."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from litsft.data import JSON
from litsft.data.base import digest_of, file_fingerprint, tokenizer_fingerprint
from litsft.errors import LitsftError


def records(path: Path, count: int) -> Path:
    path.write_text(
        "\n".join(json.dumps({"instruction": f"Say {i}", "output": f"{i}"}) for i in range(count))
    )
    return path


def test_connect_checks_the_length_and_keeps_the_runs_seed_unless_the_data_has_one(
    tmp_path, tokenizer
) -> None:
    data = JSON(json_path=tmp_path / "d.jsonl")
    with pytest.raises(LitsftError, match=r"^max_seq_length=0 must be at least 1$"):
        data.connect(tokenizer, 0, seed=1)
    data.connect(tokenizer, 32, seed=1)
    assert (data.max_seq_length, data.data_seed) == (32, 1)
    own = JSON(json_path=tmp_path / "d.jsonl", seed=7)
    own.connect(tokenizer, 32, seed=1)
    assert own.data_seed == 7


def test_the_cache_is_the_option_then_the_environment_then_the_home_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("LITSFT_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data = JSON(json_path=tmp_path / "d.jsonl")
    assert data.cache_root == tmp_path / "home" / ".cache" / "litsft"
    monkeypatch.setenv("LITSFT_CACHE_DIR", str(tmp_path / "env"))
    assert data.cache_root == tmp_path / "env"
    assert JSON(json_path=tmp_path / "d.jsonl", cache_dir=tmp_path / "mine").cache_root == tmp_path / "mine"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_workers": -1}, "--data.num_workers=-1 must be at least 0; 0 builds batches in the training process"),
        ({"val_split_fraction": 1.0}, "--data.val_split_fraction=1.0 must be at least 0 and less than 1; use e.g. 0.05, or 0 for no validation"),
        ({"tokenize_processes": 0}, "--data.tokenize_processes=0 must be at least 1; leave it unset for one per core"),
    ],
)  # fmt: skip
def test_options_every_module_has_are_checked_when_it_is_made(tmp_path, options, message) -> None:
    with pytest.raises(LitsftError) as error:
        JSON(json_path=tmp_path / "d.jsonl", **options)
    assert str(error.value) == message


@pytest.mark.parametrize(("count", "fraction", "held_out"), [(40, 0.1, 4), (10, 0.01, 1), (5, 0.5, 2)])
def test_the_validation_split_holds_out_a_seeded_share_of_the_training_records(
    tmp_path, tokenizer, count, fraction, held_out
) -> None:
    def split(seed: int) -> tuple[set, set]:
        data = JSON(
            json_path=records(tmp_path / "d.jsonl", count), cache_dir=tmp_path, val_split_fraction=fraction
        )
        data.connect(tokenizer, 64, seed)
        data.prepare()
        data.setup()

        def as_set(samples):
            return {tuple(samples.sample(i)[0]) for i in range(len(samples))}

        return as_set(data.train_samples), as_set(data.val_samples)

    train, val = split(seed=0)
    assert len(val) == held_out and len(train) == count - held_out and not train & val
    assert split(seed=0) == (train, val)
    assert split(seed=1)[1] != val  # another seed, another split


def test_the_split_truncation_and_batches_of_a_set_are_what_they_were_before_the_arrays_narrowed(
    tmp_path, tokenizer
) -> None:
    """300 records of random lengths, a tenth held out, cut to 60 tokens (145 training samples dropped,
    left without a target): where every training and validation sample starts, its length and first
    target, and two ranks' micro-batches of both splits, their digest recorded before the per-sample arrays
    became int32 and the plan flat arrays (commit 5c8b485)."""
    rng = np.random.default_rng(3)
    words = "a b c d e f g".split()
    rows = [
        {
            "instruction": " ".join(rng.choice(words, rng.integers(1, 30))),
            "output": " ".join(rng.choice(words, rng.integers(1, 12))),
        }
        for _ in range(300)
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    data = JSON(json_path=tmp_path / "d.jsonl", cache_dir=tmp_path / "cache", val_split_fraction=0.1)
    data.connect(tokenizer, max_seq_length=60, seed=9)
    data.prepare()
    data.setup()
    assert (len(data.train_samples), len(data.val_samples)) == (125, 13)
    seen = {}
    for name in ("train_samples", "val_samples"):
        samples = getattr(data, name)
        seen[name] = [samples.starts.tolist(), samples.lengths.tolist(), samples.first_targets.tolist()]
    for rank in range(2):
        seen[f"train{rank}"] = data.train_dataloader(rank, 2, 2, 8).micro_batches(1)
        seen[f"val{rank}"] = data.val_dataloader(rank, 2, 2).micro_batches()
    digest = hashlib.sha256(json.dumps(seen).encode()).hexdigest()
    assert digest == "a1f4449608872629c32f81ed006649f01482e951ef469596f0af07087c43fb3c"


def test_the_cache_entry_changes_with_the_template_and_the_mask(tmp_path, tokenizer) -> None:
    path = records(tmp_path / "d.jsonl", 4)

    def entries(**options) -> int:
        data = JSON(json_path=path, cache_dir=tmp_path / "cache", **options)
        data.connect(tokenizer, 128, seed=0)  # alpaca's prompt is long
        data.prepare()
        return len(list((tmp_path / "cache" / "sft").iterdir()))

    assert entries() == 1 and entries() == 1  # the same data again: the same entry
    assert entries(mask_prompt=False) == 2
    assert entries(prompt_style="alpaca") == 3


def test_digests(tmp_path) -> None:
    assert digest_of({"b": 1, "a": [2]}) == digest_of({"a": [2], "b": 1})
    assert digest_of({"a": 1}) == hashlib.sha256(b'{"a": 1}').hexdigest()
    (tmp_path / "x.json").write_text("[1]")
    expected = f"{(tmp_path / 'x.json').resolve()}:{hashlib.sha256(b'[1]').hexdigest()}"
    assert file_fingerprint(tmp_path / "x.json") == expected
    (tmp_path / "x.json").write_text("[2]")
    assert file_fingerprint(tmp_path / "x.json") != expected


def test_the_tokenizer_fingerprint_covers_its_files_and_nothing_else(tmp_path) -> None:
    checkpoint = SimpleNamespace(checkpoint_dir=tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    first = tokenizer_fingerprint(checkpoint)
    (tmp_path / "model.safetensors").write_text("weights")
    assert tokenizer_fingerprint(checkpoint) == first
    for name in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json", "tokenizer.json"):
        (tmp_path / name).write_text(f"{{'{name}': 2}}")
        assert tokenizer_fingerprint(checkpoint) != first
        first = tokenizer_fingerprint(checkpoint)


def test_the_fingerprint_follows_the_records(tmp_path) -> None:
    path = records(tmp_path / "d.jsonl", 4)
    first = JSON(json_path=path).fingerprint()
    assert JSON(json_path=path).fingerprint() == first
    records(path, 5)
    assert JSON(json_path=path).fingerprint() != first


def test_what_tokenizing_left_out_is_said_once_per_run_and_truncation_with_its_size(
    tmp_path, tokenizer, capsys
) -> None:
    """Skipped records (with the first reasons), conversations whose opening reply was left out, and samples
    cut to max_seq_length are each one line of the run's log, on every run of the same cached data."""
    lines = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "tool_calls": [{"function": {"name": "get", "arguments": "{x"}}]}]},
        {"instruction": "Say a long thing", "output": " ".join(["word"] * 40)},
    ]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    expected = [
        f"Skipped 1 of 4 training records that cannot be trained on as they are (--data.skip_invalid false stops "
        f"at the first instead): {path} line 3 (record 3): message 1 tool_calls[0] (get) has arguments that "
        "are not valid JSON (Expecting property name enclosed in double quotes at column 2); fix the call or "
        "drop the record",
        "1 of 4 training records open with an assistant turn before any user message: it answers no prompt, "
        "so it is left out and the rest of the conversation is trained on",
    ]
    for run in range(2):  # the first run tokenizes, the second reads the cache
        data = JSON(json_path=path, cache_dir=tmp_path / "cache", val_split_fraction=0)
        data.connect(tokenizer, 100, seed=0)
        data.prepare()
        printed = capsys.readouterr().out.splitlines()
        assert printed[:2] == expected
        assert printed[2] == (
            "Truncated 1 of 3 training samples to max_seq_length=100: 73 tokens cut from their ends (at most 73 "
            "from one, 73 on average); raise --train.max_seq_length to train on them whole"
        )
        took = r"tokenized in \d+\.\d s" if run == 0 else "read from the cache"
        assert re.fullmatch(
            r"Prepared the train data: 4 records, 3 samples, 272 tokens, 1 longer than max_seq_length=100, "
            rf"1 skipped; {took}",
            printed[3],
        )
        data.setup()
        assert data.train_samples.lengths.tolist() == [49, 49, 101]  # the opening reply gone; 174 cut to 101
    data = JSON(json_path=path, cache_dir=tmp_path / "strict", val_split_fraction=0, skip_invalid=False)
    data.connect(tokenizer, 100, seed=0)
    with pytest.raises(LitsftError, match=rf"^{path} line 3 \(record 3\): message 1 tool_calls\[0\] \(get\)"):
        data.prepare()
    assert not (tmp_path / "strict").exists() or not any((tmp_path / "strict").rglob("meta.json"))
    path.write_text(json.dumps(lines[2]))
    data = JSON(json_path=path, cache_dir=tmp_path / "cache", val_split_fraction=0)
    data.connect(tokenizer, 100, seed=0)
    with pytest.raises(
        LitsftError, match=r"^every train record was skipped as untrainable; the first: .* line 1"
    ):
        data.prepare()
