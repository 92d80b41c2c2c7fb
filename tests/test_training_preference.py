"""Preference tuning end to end (`--objective.name dpo|ipo|simpo|orpo` on finetune_full and finetune_lora),
against independent references: TRL's DPOTrainer for DPO and IPO (tests/trl_reference.py drives it on the very
token ids litsft trains on), the papers' formulas in a hand-written loop for SimPO and ORPO; packed equals
unpacked, one process equals two, a resumed run equals the uninterrupted one. The objectives' formulas and the
pair data are unit-tested in test_training_objectives_*.py and test_data_pairs.py."""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import TINY_MOE, WORDS, litsft, litsft_in_process, stopped_copy, write_tiny_checkpoint
from safetensors.torch import load_file
from tiny_hf import save_tiny_hf, tiny_hf_model

from litsft.data.chat import ChatFormat
from litsft.data.loader import pack_rows
from litsft.data.records import to_conversation
from litsft.data.tokenizer import Tokenizer

PAIRS = 8
LR = 1e-3


def write_pairs(path: Path, count: int = PAIRS, seed: int = 0) -> list[dict]:
    """Short preference records (a whole set fits one packed row of 512 tokens), some replies sharing words."""
    rng = random.Random(seed)
    words = lambda low, high: " ".join(rng.choices(WORDS, k=rng.randint(low, high)))  # noqa: E731
    records = [{"prompt": words(1, 4), "chosen": words(1, 3), "rejected": words(1, 3)} for _ in range(count)]
    path.write_text(json.dumps(records))
    return records


def preference_args(
    model: Path, data: Path, out: Path, objective: str, *extra: str, packed_rows: int | None = None
) -> list[str]:
    """Every step trains on all the pairs (one global batch: `packed_rows` rows of them, else one pair per
    micro-batch row), fp32, a constant learning rate: what the reference trainers run."""
    packing = packed_rows is not None
    batch = ["--train.global_batch_size", str(packed_rows), "--train.micro_batch_size", "1"]
    if not packing:
        batch = ["--train.global_batch_size", str(PAIRS), "--train.micro_batch_size", str(PAIRS // 2)]
    return [
        "finetune_full", str(model), "--data", "JSON", "--data.json_path", str(data),
        "--data.val_split_fraction", "0", "--data.packing", str(packing).lower(),
        "--objective.name", objective, "--out_dir", str(out), "--accelerator", "cpu", "--precision", "32-true",
        "--train.max_seq_length", "512", "--train.max_steps", "3", "--train.log_interval", "1", *batch,
        "--optimizer.lr", str(LR), "--optimizer.schedule", "constant", "--optimizer.betas", "[0.9, 0.95]",
        "--train.max_norm", "1.0", *extra,
    ]  # fmt: skip


def train_rows(out: Path) -> list[dict[str, float]]:
    with (out / "metrics.csv").open() as file:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(file) if row["loss"]]


def packed_rows(model: Path, records: list[dict], max_seq_length: int = 512) -> int:
    """The rows litsft packs the pairs into (each pair's two samples fill their tokens but one each)."""
    conversations = [to_conversation(record) for record in records]
    lengths = ChatFormat(Tokenizer(model), pairs=True).tokenize_many(conversations).lengths
    positions = (lengths - 1).reshape(-1, 2).sum(axis=1)
    return len(pack_rows(positions, np.arange(len(positions)), max_seq_length))


def tokenized_pairs(model: Path, records: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """The (prompt, chosen, rejected) token ids litsft trains on, as the chat template renders the pairs."""
    chat_format = ChatFormat(Tokenizer(model), pairs=True)
    tokens, targets, lengths, _ = chat_format.tokenize_many([to_conversation(record) for record in records])
    pairs, start = [], 0
    samples = []
    for length in lengths.tolist():
        ids, is_target = tokens[start : start + length].tolist(), targets[start : start + length]
        # The reply is its target tokens; what the template writes after the end-of-turn token (a newline) is
        # not trained on (litsft.data.chat._reply_span), so TRL is not given it to score either.
        first, last = int(is_target.argmax()), len(is_target) - int(is_target[::-1].argmax())
        samples.append((ids[:first], ids[first:last]))
        start += length
    for (prompt, chosen), (same_prompt, rejected) in zip(samples[0::2], samples[1::2]):
        assert prompt == same_prompt
        pairs.append((prompt, chosen, rejected))
    return pairs


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf(tiny_hf_model("llama", seed=3), tmp_path_factory.mktemp("tiny-llama-hf"))


@pytest.mark.parametrize(
    ("objective", "packing"),
    [("dpo", True), ("dpo", False), ("ipo", True)],
    ids=["dpo-packed", "dpo-unpacked", "ipo"],
)
def test_dpo_and_ipo_equal_trls_dpo_trainer_step_by_step(
    hf_model: Path, tmp_path: Path, capsys, objective: str, packing: bool
) -> None:
    """Loss and rewards of every step within 1e-5 of TRL's DPOTrainer (precomputed reference), and the
    weights after three steps; the pairs are those litsft tokenized, fed to TRL as token ids."""
    from trl_reference import trl_preference_run

    data, out = tmp_path / "pairs.json", tmp_path / "out"
    records = write_pairs(data)
    beta = "0.1"
    pairs = tokenized_pairs(hf_model, records)
    rows = packed_rows(hf_model, records) if packing else None
    args = preference_args(hf_model, data, out, objective, "--objective.beta", beta, packed_rows=rows)
    litsft_in_process(args, tmp_path, capsys)
    trl_logs, trl_weights = trl_preference_run(
        hf_model,
        pairs,
        tmp_path / "trl",
        loss_type="sigmoid" if objective == "dpo" else "ipo",
        beta=float(beta),
        steps=3,
        lr=LR,
        max_grad_norm=1.0,
    )
    rows = train_rows(out)
    assert len(rows) == len(trl_logs) == 3
    names = {"loss": "loss", "reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected"}
    names |= {"reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins"}
    for row, reference in zip(rows, trl_logs):
        for ours, theirs in names.items():
            assert row[ours] == pytest.approx(reference[theirs], abs=1e-5), (ours, row["step"])
    assert rows[-1]["reward_margin"] > 0.05  # the three steps learned the preference

    litsft_in_process(
        ["convert_to_hf", str(out / "final"), "--out_dir", str(tmp_path / "hf")], tmp_path, capsys
    )
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == trl_weights.keys()
    assert max((exported[k] - trl_weights[k]).abs().max().item() for k in exported) < 1e-5


def test_lora_dpo_equals_trls_dpo_trainer_with_peft(hf_model: Path, tmp_path: Path, capsys) -> None:
    """LoRA on q and v (rank 4, alpha 8, no dropout): every step's loss and rewards, and the adapters after
    three steps (exported as a PEFT adapter), within 1e-5 of TRL's DPOTrainer on a PEFT model started from the
    same adapters (litsft's initial ones: a run whose one update is 1e-30 of a step), its reference the base."""
    from trl_reference import trl_preference_run

    data = tmp_path / "pairs.json"
    records = write_pairs(data)
    lora = ["--lora.targets", "[q, v]", "--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0"]
    runs = {"trained": [], "initial": ["--train.max_steps", "1", "--optimizer.lr", "1e-30"]}
    exported = {}
    for name, extra in runs.items():
        out = tmp_path / name
        args = preference_args(hf_model, data, out, "dpo", *lora, *extra)
        litsft_in_process(["finetune_lora", *args[1:]], tmp_path, capsys)
        peft_dir = tmp_path / f"{name}-peft"
        export = ["convert_to_hf", str(out / "final"), "--out_dir", str(peft_dir), "--lora_format", "peft"]
        litsft_in_process(export, tmp_path, capsys)
        exported[name] = load_file(peft_dir / "adapter_model.safetensors")
    trl_logs, trl_adapters = trl_preference_run(
        hf_model,
        tokenized_pairs(hf_model, records),
        tmp_path / "trl",
        lr=LR,
        max_grad_norm=1.0,
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        initial_adapters=exported["initial"],
    )
    rows = train_rows(tmp_path / "trained")
    for row, reference in zip(rows, trl_logs, strict=True):
        assert row["loss"] == pytest.approx(reference["loss"], abs=1e-5)
        assert row["reward_margin"] == pytest.approx(reference["rewards/margins"], abs=1e-5)
        assert row["reward_chosen"] == pytest.approx(reference["rewards/chosen"], abs=1e-5)
    ours = exported["trained"]
    assert ours.keys() == trl_adapters.keys()
    assert max((ours[k] - trl_adapters[k]).abs().max().item() for k in ours) < 1e-5


def sequence_logps(
    model: torch.nn.Module, pairs: list[tuple[list[int], list[int], list[int]]]
) -> torch.Tensor:
    """(P, 2, 2): each pair's chosen and rejected reply's summed log-probability and token count, one
    sequence at a time through the transformers model."""
    scores = []
    for prompt, *replies in pairs:
        pair = []
        for reply in replies:
            ids = torch.tensor([prompt + reply])
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            summed = logps[torch.arange(len(targets)), targets][len(prompt) - 1 :].sum()
            pair.append(torch.stack([summed, torch.tensor(float(len(reply)))]))
        scores.append(torch.stack(pair))
    return torch.stack(scores)


def simpo_loss(scores: torch.Tensor, beta: float = 2.0, gamma: float = 0.5) -> torch.Tensor:
    """SimPO's eq. 6: -log sigmoid(beta/|yw| log pi(yw|x) - beta/|yl| log pi(yl|x) - gamma)."""
    mean = scores[..., 0] / scores[..., 1]
    return -torch.nn.functional.logsigmoid(beta * mean[:, 0] - beta * mean[:, 1] - gamma).mean()


def orpo_loss(scores: torch.Tensor, lam: float = 0.1) -> torch.Tensor:
    """ORPO's eqs. 6-8: the chosen reply's mean NLL plus lambda x -log sigmoid(log odds ratio), odds(y) =
    P(y) / (1 - P(y)) with P(y) = exp(mean log-probability per token)."""
    mean = scores[..., 0] / scores[..., 1]
    odds = mean - torch.log(1 - torch.exp(mean))
    return (-mean[:, 0] - lam * torch.nn.functional.logsigmoid(odds[:, 0] - odds[:, 1])).mean()


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_simpo_and_orpo_equal_a_hand_written_loop_of_their_papers_formulas(
    hf_model: Path, tmp_path: Path, capsys, objective: str
) -> None:
    """Reference-free objectives: every step's loss, and the weights after three steps, within 1e-5 of a plain
    loop over the transformers model (AdamW, the same clipping) computing each paper's loss."""
    from transformers import AutoModelForCausalLM

    data, out = tmp_path / "pairs.json", tmp_path / "out"
    records = write_pairs(data)
    pairs = tokenized_pairs(hf_model, records)
    litsft_in_process(preference_args(hf_model, data, out, objective, packed_rows=packed_rows(hf_model, records)),
                      tmp_path, capsys)  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(3):
        loss = (simpo_loss if objective == "simpo" else orpo_loss)(sequence_logps(model, pairs))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert [row["loss"] for row in train_rows(out)] == pytest.approx(losses, abs=1e-5)
    litsft_in_process(
        ["convert_to_hf", str(out / "final"), "--out_dir", str(tmp_path / "hf")], tmp_path, capsys
    )
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    expected = model.state_dict()
    assert max((exported[k] - expected[k]).abs().max().item() for k in exported) < 1e-5


def test_dpo_on_two_and_four_processes_killed_and_relaunched_equals_one_process(
    tmp_path: Path, capsys
) -> None:
    """Full DPO and LoRA DPO: two processes (FULL_SHARD; pairs dealt whole to each rank), killed after step 3
    and relaunched, train the weights of one process, and so do four (full); a one-process run stopped after
    step 2 and relaunched ends bit for bit where the uninterrupted run does (the reference log-probabilities
    read back from out_dir)."""
    from crash_harness import crash_and_recover

    model, data = write_tiny_checkpoint(tmp_path / "model", seed=2), tmp_path / "pairs.json"
    write_pairs(data, count=16, seed=1)
    common = ["--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--train.save_interval", "1",
              "--train.max_steps", "4", "--data.val_split_fraction", "0.25", "--eval.interval", "2",
              "--objective.name", "dpo", "--optimizer.lr", "1e-3", "--accelerator", "cpu", "--train.max_seq_length", "256"]  # fmt: skip
    for recipe, final in (("finetune_full", "model.safetensors"), ("finetune_lora", "adapter.safetensors")):
        args = [recipe, str(model), "--data", "JSON", "--data.json_path", str(data), *common]
        one = tmp_path / f"{recipe}-one"
        litsft_in_process([*args, "--out_dir", str(one)], tmp_path, capsys)
        a = load_file(one / "final" / final)
        rows = train_rows(one)
        assert rows[-1]["reward_accuracy"] >= 0.5 and rows[-1]["loss"] < rows[0]["loss"], recipe

        two = tmp_path / f"{recipe}-two"
        crash_and_recover([*args, "--out_dir", str(two), "--devices", "2"], tmp_path, ["after_step_3"])
        b = load_file(two / "final" / final)
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5, recipe
        if recipe == "finetune_full":
            four = tmp_path / f"{recipe}-four"
            litsft([*args, "--out_dir", str(four), "--devices", "4"], tmp_path)
            b = load_file(four / "final" / final)
            assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5, "four processes"

        resumed = stopped_copy(one, tmp_path / f"{recipe}-resumed", last_step=4)
        shutil.rmtree(resumed / "step-00000003")
        litsft_in_process([*args, "--out_dir", str(resumed)], tmp_path, capsys)
        c = load_file(resumed / "final" / final)
        assert max((a[k] - c[k]).abs().max().item() for k in a) == 0, recipe


def test_lora_dpo_with_a_live_reference_equals_the_precomputed_one(tmp_path: Path, capsys) -> None:
    """--objective.reference live scores the reference with the adapters switched off in every step, instead of
    one pass before training: the same adapters (LoRA's dropout on, which the base does not see), also on a
    mixture of experts with adapters on its experts (which take no dropout). Where it cannot be the base it is refused in one line."""
    data = tmp_path / "pairs.json"
    write_pairs(data, count=12, seed=2)
    common = ["--data", "JSON", "--data.json_path", str(data), "--objective.name", "dpo", "--train.max_steps", "3",
              "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--optimizer.lr", "1e-3",
              "--accelerator", "cpu", "--train.max_seq_length", "256", "--data.val_split_fraction", "0"]  # fmt: skip
    for name, overrides, targets in (
        ("dense", {}, ["[q, v]"]),
        ("moe", TINY_MOE, ["[q, experts]", "--lora.dropout", "0"]),
    ):
        model = write_tiny_checkpoint(tmp_path / f"model-{name}", seed=4, **overrides)
        adapters = {}
        for reference in ("precomputed", "live"):
            out = tmp_path / f"{name}-{reference}"
            args = ["finetune_lora", str(model), *common, "--lora.targets", *targets, "--out_dir", str(out)]
            litsft_in_process([*args, "--objective.reference", reference], tmp_path, capsys)
            adapters[reference] = load_file(out / "final" / "adapter.safetensors")
        assert (tmp_path / f"{name}-precomputed" / "reference_logps").is_dir()
        assert not (tmp_path / f"{name}-live" / "reference_logps").exists()
        a, b = adapters["precomputed"], adapters["live"]
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6, name

    model = tmp_path / "model-dense"
    refusals = {
        "finetune_full": "--objective.reference live scores the reference with LoRA's adapters switched off",
        "finetune_lora": "--objective.reference live switches the adapters off to score the reference, but PiSSA",
    }
    for recipe, message in refusals.items():
        extra = ["--lora.variant", "pissa"] if recipe == "finetune_lora" else []
        out = tmp_path / f"refused-{recipe}"
        args = [recipe, str(model), *common, *extra, "--objective.reference", "live", "--out_dir", str(out)]
        result = litsft_in_process(args, tmp_path, capsys, check=False)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
        assert not out.exists()
