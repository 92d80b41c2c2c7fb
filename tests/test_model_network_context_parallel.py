"""litsft/model/network/context_parallel.py: `split_for_context` on the host (padding, labels, loss positions,
documents), and context groups of 2 and 4 gloo processes against one process: the loss and every parameter's
gradient, summed over the ranks, of tiny models of each attention feature (documents, sliding windows,
soft-capping, q/k norms, LongRoPE, grouped-query attention with fewer kv heads than ranks), a mixture of experts
with its load-balancing loss, and LoRA with dropout."""

from __future__ import annotations

import math

import pytest
import torch
from launch import TINY_MOE, TINY_PHI3, on_ranks

from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import apply_lora
from litsft.model.network.attention import Documents
from litsft.model.network.batch import loss_positions_of, model_inputs, split_for_context
from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.sample_dropout import context_samples, dropout_samples, samples_in_micro_batch
from litsft.model.network.transformer import Transformer

VOCAB = 512


def packed_batch(rows: list[list[int]], width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated packed batch (the loader's keys): `rows` the document lengths of each row of `width` tokens,
    padding (document id -1) after them, each document's first two labels masked as a prompt."""
    generator = torch.Generator().manual_seed(seed)
    B = len(rows)
    input_ids = torch.randint(0, VOCAB, (B, width), generator=generator)
    labels = torch.randint(0, VOCAB, (B, width), generator=generator)
    document_ids = torch.full((B, width), -1)
    position_ids = torch.zeros(B, width, dtype=torch.long)
    lengths = []
    for row, documents in enumerate(rows):
        start = 0
        for index, length in enumerate(documents):
            document_ids[row, start : start + length] = index
            position_ids[row, start : start + length] = torch.arange(length)
            labels[row, start : start + 2] = -100
            lengths.append(length)
            start += length
    labels[document_ids < 0] = -100
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(lengths).cumsum(0)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": torch.tensor(max(lengths)),
        "row_lengths": torch.tensor([sum(documents) for documents in rows]),
    }


def unpacked_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated unpacked batch: rows right-padded to the longest, a prompt of three tokens masked."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(0, VOCAB, (len(lengths), width), generator=generator)
    labels = torch.randint(0, VOCAB, (len(lengths), width), generator=generator)
    labels[:, :3] = -100
    for row, length in enumerate(lengths):
        labels[row, length:] = -100
    return {"input_ids": input_ids, "labels": labels, "row_lengths": torch.tensor(lengths)}


BATCHES = {
    # 33 real tokens, not a multiple of 2 or 4; documents longer than the windows of 6 and 8 below, and
    # than Phi-3's 32 original positions (LongRoPE's long factors) where one row is one document.
    "packed": lambda: packed_batch([[9, 11], [13]], width=24),
    "packed-full-rows": lambda: packed_batch([[5, 6], [11], [3, 8]], width=11, seed=1),  # nothing to drop
    "unpacked": lambda: unpacked_batch([13, 9, 11], seed=2),  # 3 x 13 = 39 tokens
    "long-document": lambda: packed_batch([[37]], width=40, seed=3),  # past LongRoPE's switch
}


def tiny_model(name: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(Config.from_name(name, **overrides))
    model.init_weights(1)
    if model.config.num_experts:
        with torch.no_grad():  # routers far from uniform, so that routing decides which experts learn
            for block in model.blocks:
                block.mlp.router.weight.mul_(50)
    return model.train()


def tiny_lora() -> Transformer:
    model = apply_lora(tiny_model("tiny-llama"), LoRAConfig(rank=4, dropout=0.3))
    with torch.no_grad():  # B starts at zero: give every adapter's A a gradient to compare
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(
                    torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1
                )
    return model


MODELS = {
    "llama": lambda: tiny_model("tiny-llama"),  # 4 query heads, 2 kv heads: K < N = 4, K % N == 0 for N = 2
    "mistral-window": lambda: tiny_model(
        "tiny-llama", hf_architecture="MistralForCausalLM", sliding_window=6
    ),
    "gemma2": lambda: tiny_model("tiny-gemma2", sliding_window=8),  # soft-capped, sliding and global layers
    "qwen3": lambda: tiny_model("tiny-llama", hf_architecture="Qwen3ForCausalLM", qk_norm=True),
    "phi3-longrope": lambda: tiny_model("tiny-llama", **TINY_PHI3),
    "kv-heads-4": lambda: tiny_model("tiny-llama", num_kv_heads=4),  # K % N == 0 for N = 4
    "moe": lambda: tiny_model("tiny-llama", **dict(TINY_MOE, router_aux_loss_coef=0.5)),
    "lora-dropout": tiny_lora,
}
CASES = [(model, batch) for model in MODELS for batch in BATCHES if batch != "long-document"]
CASES += [("phi3-longrope", "long-document"), ("llama", "long-document")]
SEED, STEP = 7, 3


def dropout_of(batch: dict[str, torch.Tensor], inputs: dict) -> object:
    """The whole micro-batch's dropout samples, as the training step makes them for one process."""
    rows, width = inputs["input_ids"].shape
    lengths = batch["row_lengths"].tolist()
    return samples_in_micro_batch(lengths, width, rows != len(lengths), 0, SEED, STEP)


def loss_and_gradients(model_name: str, batch_name: str, shard: ContextShard | None) -> tuple[float, dict]:
    """The loss and gradients of one case: the whole micro-batch in one process (`shard` None), else this
    context rank's share of it."""
    model, batch = MODELS[model_name](), BATCHES[batch_name]()
    inputs = model_inputs(batch)
    samples = dropout_of(batch, inputs)
    if shard is not None:
        inputs = split_for_context(inputs, shard)
        samples = context_samples(samples, shard, inputs["position_ids"].shape[1])
    with dropout_samples(model, samples):
        loss = model(**inputs)
        loss.backward()
    gradients = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), gradients


def all_cases_on_this_rank() -> dict:
    import torch.distributed as dist

    shard = ContextShard(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    return {case: loss_and_gradients(*case, shard) for case in CASES}


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_context_group_trains_as_one_process(tmp_path, ranks: int) -> None:
    """Every case (model x batch) on `ranks` gloo processes each holding 1/N of the tokens: the losses of the
    ranks add up to one process's and so do their gradients, every parameter's, within 1e-5."""
    answers = on_ranks(ranks, all_cases_on_this_rank, tmp_path)
    for case in CASES:
        expected_loss, expected = loss_and_gradients(*case, None)
        loss = sum(answers[rank][case][0] for rank in range(ranks))
        assert loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-5), case
        assert set(answers[0][case][1]) == set(expected), case
        for name, gradient in expected.items():
            summed = sum(torch.from_numpy(answers[rank][case][1][name]) for rank in range(ranks))
            torch.testing.assert_close(
                summed, torch.from_numpy(gradient), rtol=0, atol=1e-5, msg=f"{case} {name}"
            )
        assert max(abs(g).max() for g in expected.values()) > 1e-3  # something was compared


# ---- the host-side split ----------------------------------------------------------------------------------
def test_split_joins_pads_and_slices_a_packed_batch() -> None:
    """33 real tokens over 4 ranks: one padding document of 3 tokens, labels -100, positions counted from 0,
    each rank 9 tokens with its labels and their loss positions, positions and documents whole."""
    batch = packed_batch([[9, 11], [13]], width=24)
    inputs = model_inputs(batch)
    real_ids, real_labels = inputs["input_ids"][0], inputs["labels"][0]
    pieces = [split_for_context(inputs, ContextShard(None, rank, 4)) for rank in range(4)]
    for rank, piece in enumerate(pieces):
        assert piece["context"].rank == rank
        assert piece["input_ids"].shape == piece["labels"].shape == (1, 9)
        assert piece["position_ids"].shape == (1, 36)
        assert piece["documents"].cu_seqlens.tolist() == [0, 9, 20, 33, 36]
        assert piece["documents"].max_seqlen == 13
        assert torch.equal(piece["loss_positions"], loss_positions_of(piece["labels"]))
        assert "document_ids" not in piece
    assert torch.equal(torch.cat([p["input_ids"][0] for p in pieces])[:33], real_ids)
    labels = torch.cat([p["labels"][0] for p in pieces])
    assert torch.equal(labels[:33], real_labels) and labels[33:].tolist() == [-100] * 3
    assert pieces[0]["position_ids"][0, 30:].tolist() == [10, 11, 12, 0, 1, 2]


def test_split_makes_each_unpacked_row_a_document() -> None:
    """Rows (3, 13) become one row of three 13-token documents and a padding document of 1 (39 -> 40 over 4),
    positions counted per row; over 3 ranks (39 tokens) nothing is added."""
    batch = unpacked_batch([13, 9, 11])
    inputs = model_inputs(batch)
    piece = split_for_context(inputs, ContextShard(None, 1, 4))
    assert piece["documents"].cu_seqlens.tolist() == [0, 13, 26, 39, 40]
    assert piece["position_ids"][0].tolist() == list(range(13)) * 3 + [0]
    assert torch.equal(piece["input_ids"][0], batch["input_ids"].flatten()[10:20])
    assert torch.equal(piece["labels"][0], batch["labels"].flatten()[10:20])
    last = split_for_context(inputs, ContextShard(None, 3, 4))
    assert last["labels"][0, -1] == -100 and last["loss_positions"].max() < 9
    even = split_for_context(inputs, ContextShard(None, 2, 3))
    assert even["documents"].cu_seqlens.tolist() == [0, 13, 26, 39]
    assert torch.equal(even["input_ids"][0], batch["input_ids"].flatten()[26:])


def test_split_joins_packed_rows_that_had_no_padding_to_drop() -> None:
    inputs = model_inputs(packed_batch([[5, 6], [11], [3, 8]], width=11))
    assert inputs["input_ids"].shape == (3, 11)  # model_inputs left them as they were
    piece = split_for_context(inputs, ContextShard(None, 0, 2))
    assert piece["documents"].cu_seqlens.tolist() == [0, 5, 11, 22, 25, 33, 34]
    assert torch.equal(piece["input_ids"][0], inputs["input_ids"].flatten()[:17])


def test_split_keeps_documents_when_nothing_is_padded() -> None:
    documents = Documents(torch.tensor([0, 3, 8], dtype=torch.int32), 5)
    inputs = {
        "input_ids": torch.arange(8)[None],
        "labels": torch.arange(8)[None],
        "documents": documents,
        "loss_positions": torch.arange(8),
    }
    piece = split_for_context(inputs, ContextShard(None, 1, 2))
    assert piece["documents"] is documents
    assert piece["input_ids"].tolist() == [[4, 5, 6, 7]] and piece["loss_positions"].tolist() == [0, 1, 2, 3]
    assert piece["position_ids"].tolist() == [list(range(8))]  # made whole where none were given


def test_context_samples_are_each_ranks_slice_of_the_whole_masks() -> None:
    """A context rank's dropout masks are its rows of one process's, sample by sample."""
    from litsft.model.network.sample_dropout import SampleDropout

    dropout = SampleDropout(0.4).train()
    model = torch.nn.Sequential(dropout)
    samples = samples_in_micro_batch([5, 7, 3], row_width=7, joined=False, first_position=3, seed=1, step=2)
    x = torch.ones(1, 21, 6)
    with dropout_samples(model, samples):
        whole = model(x)[0]
    pieces = []
    for rank in range(4):
        with dropout_samples(model, context_samples(samples, ContextShard(None, rank, 4), 24)):
            pieces.append(model(torch.ones(1, 6, 6))[0])
    masks = torch.cat(pieces)
    assert torch.equal(masks[:21], whole) and torch.equal(masks[21:], torch.ones(3, 6))
    assert (whole == 0).any()  # some values were dropped


def test_size_one_is_the_plain_model() -> None:
    model = tiny_model("tiny-llama")
    inputs = model_inputs(packed_batch([[9, 11], [13]], width=24))
    single = split_for_context(inputs, ContextShard(None, 0, 1))
    assert torch.equal(model(**inputs), model(**single))
    assert math.isfinite(model(**single).item())
