"""litsft/training/reference.py: the reference log-probability of every preference sample, scored once by the
starting model (each sample's summed log-probability of its reply), written to out_dir/reference_logps and read
back by a relaunch over the same samples and precision, scored again when either changed, and handed to the
loaders whose batches then carry it."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from tiny_pairs import tiny_llama

import litsft.training.reference as reference
from litsft.data.json_data import JSON
from litsft.data.samples import Samples
from litsft.data.tokenizer import Tokenizer
from litsft.model.network.transformer import Transformer
from litsft.training.args import RunConfig, TrainConfig
from litsft.training.reference import REFERENCE_DIR, attach_reference, split_reference

WORDS = "the a small red cat dog runs jumps blue river king queen hello world why how yes no".split()


def write_pairs(path: Path, count: int) -> None:
    rng = random.Random(0)
    words = lambda low, high: " ".join(rng.choices(WORDS, k=rng.randint(low, high)))  # noqa: E731
    records = [{"prompt": words(1, 6), "chosen": words(1, 5), "rejected": words(1, 5)} for _ in range(count)]
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")


def pair_data(tmp_path: Path, tokenizer: Tokenizer, packing: bool, count: int = 7) -> JSON:
    write_pairs(tmp_path / "pairs.jsonl", count)
    data = JSON(
        json_path=tmp_path / "pairs.jsonl",
        cache_dir=tmp_path / "cache",
        val_split_fraction=0.0,
        packing=packing,
    )
    data.train_pairs()
    data.connect(tokenizer, 160, seed=0)
    data.prepare()
    data.setup()
    assert len(data.train_samples) == 2 * count
    return data


@pytest.fixture(scope="module")
def fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision="32-true")


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_llama()


def run_config(model: Transformer, data: JSON, out_dir: Path, micro_batch_size: int = 2) -> RunConfig:
    return RunConfig(
        config=model.config,
        tokenizer_dir=None,
        data=data,
        out_dir=out_dir,
        accelerator="cpu",
        precision="32-true",
        train=TrainConfig(micro_batch_size=micro_batch_size, global_batch_size=micro_batch_size),
    )


def by_hand(model: Transformer, samples: Samples) -> np.ndarray:
    """Each sample's summed log-probability of its targets, from the logits of the sample alone."""
    values = []
    with torch.no_grad():
        for i in range(len(samples)):
            tokens, targets = (torch.from_numpy(np.array(a)) for a in samples.sample(i))
            log_probs = torch.log_softmax(model(tokens[None, :-1].long())[0].double(), dim=-1)
            picked = log_probs.gather(1, tokens[1:].long()[:, None])[:, 0]
            values.append(float(picked[targets[1:]].sum()))
    return np.array(values)


def no_forward_pass(*args, **kwargs):
    raise AssertionError("scored again")


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_each_samples_reference_is_its_reply_log_probability_under_the_model(
    tmp_path: Path, tokenizer: Tokenizer, fabric: Fabric, model: Transformer, packing: bool
) -> None:
    """7 pairs in micro-batches of 2 (unpacked: 2 pairs, packed: 2 rows of pairs): the last batch has filler
    rows, which score nothing. The model is left in training mode, as it was."""
    data = pair_data(tmp_path, tokenizer, packing)
    run = run_config(model, data, tmp_path / "out")
    model.train()
    values = split_reference(fabric, model, run, "train")
    assert model.training
    assert values.dtype == np.float64 and values.shape == (14,)
    np.testing.assert_allclose(values, by_hand(model, data.train_samples), rtol=1e-5, atol=1e-4)
    saved = tmp_path / "out" / REFERENCE_DIR / "train.npy"
    np.testing.assert_array_equal(np.load(saved), values)
    identity = json.loads(saved.with_suffix(".json").read_text())
    assert identity["split"] == "train" and identity["precision"] == "32-true"
    assert identity["data"] == data.fingerprint()


def test_a_relaunch_reads_the_saved_values_and_other_precision_or_samples_score_again(
    tmp_path: Path, tokenizer: Tokenizer, fabric: Fabric, model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = pair_data(tmp_path, tokenizer, packing=True)
    run = run_config(model, data, tmp_path / "out")
    first = split_reference(fabric, model, run, "train")

    monkeypatch.setattr(reference, "sequence_logps", no_forward_pass)
    again = split_reference(fabric, model, run, "train")
    np.testing.assert_array_equal(again, first)
    # Another micro-batch size or packing deals the same samples: still read, not scored.
    np.testing.assert_array_equal(
        split_reference(fabric, model, run_config(model, data, run.out_dir, 1), "train"), first
    )

    bf16 = dataclasses.replace(run, precision="bf16-true")
    with pytest.raises(AssertionError, match="scored again"):
        split_reference(fabric, model, bf16, "train")
    # Other samples (a shorter max_seq_length truncates the pairs): scored again too.
    data.connect(tokenizer, 40, seed=0)
    data.setup()
    with pytest.raises(AssertionError, match="scored again"):
        split_reference(fabric, model, run, "train")

    monkeypatch.undo()
    values = split_reference(fabric, model, bf16, "train")
    np.testing.assert_allclose(values, by_hand(model, data.train_samples), rtol=1e-5, atol=1e-4)
    meta = json.loads((run.out_dir / REFERENCE_DIR / "train.json").read_text())
    assert meta["precision"] == "bf16-true"  # the file now holds the new values
    assert not list((run.out_dir / REFERENCE_DIR).glob(".*partial"))


def test_a_damaged_or_foreign_file_is_scored_again(
    tmp_path: Path, tokenizer: Tokenizer, fabric: Fabric, model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = pair_data(tmp_path, tokenizer, packing=False, count=3)
    run = run_config(model, data, tmp_path / "out")
    expected = split_reference(fabric, model, run, "train")
    saved = run.out_dir / REFERENCE_DIR / "train.npy"
    np.save(saved, np.zeros(5))  # the wrong number of values under the right identity
    assert np.array_equal(split_reference(fabric, model, run, "train"), expected)
    saved.write_bytes(b"not a numpy file")
    assert np.array_equal(split_reference(fabric, model, run, "train"), expected)
    monkeypatch.setattr(reference, "sequence_logps", no_forward_pass)
    assert np.array_equal(split_reference(fabric, model, run, "train"), expected)  # rewritten whole


def test_the_loaders_batches_carry_each_sequences_reference(
    tmp_path: Path, tokenizer: Tokenizer, fabric: Fabric, model: Transformer
) -> None:
    data = pair_data(tmp_path, tokenizer, packing=True)
    run = run_config(model, data, tmp_path / "out")
    loader = data.train_dataloader(0, 1, 1, 2)
    attach_reference(fabric, model, run, {"train": loader, "val": None})
    values = loader.per_sample["reference_logps"]
    np.testing.assert_allclose(values, by_hand(model, data.train_samples), rtol=1e-5, atol=1e-4)
    batches = list(loader)
    assert batches
    for batch in batches:
        index = batch["sequence_samples"]
        assert (index >= 0).all()
        torch.testing.assert_close(batch["reference_logps"], torch.from_numpy(values[index.numpy()]))


def test_a_rank_whose_last_ordered_batch_is_all_filler_scores_its_samples(
    tmp_path: Path, tokenizer: Tokenizer, fabric: Fabric, model: Transformer
) -> None:
    """Rank 1 of 2 data replicas (this one process standing in for it), packed, micro-batches of one row."""
    data = pair_data(tmp_path, tokenizer, packing=True, count=7)
    loader = data.ordered_dataloader("train", 1, 2, 1)
    assert any(not any(rows) for rows in loader.micro_batches())  # the premise: an all-filler micro-batch
    layout = SimpleNamespace(data_rank=lambda global_rank: 1, data_replicas=2)
    run = SimpleNamespace(
        layout=layout, data=data, train=SimpleNamespace(micro_batch_size=1), out_dir=tmp_path / "out",
        precision="32-true",
    )  # fmt: skip
    values = split_reference(fabric, model, run, "train")
    scored = {
        i for rows in loader.micro_batches() for row in rows for unit in row for i in (2 * unit, 2 * unit + 1)
    }
    expected = by_hand(model, data.train_samples)
    for i in range(14):
        assert values[i] == pytest.approx(expected[i], rel=1e-5, abs=1e-4) if i in scored else values[i] == 0
