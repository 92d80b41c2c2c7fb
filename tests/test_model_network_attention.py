"""litsft/model/network/attention.py: every kernel against the boolean-mask path, the kernel choice, the document boundaries
the data loader builds, and no recompilation for new document layouts. The flash kernels (varlen_attn, and
flex_attention's backward) run on CUDA only: on the CPU their glue is checked against a reference varlen_attn
written here; on a GPU the real kernels are checked against the mask path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from litsft.data.loader import collate
from litsft.data.samples import Samples
from litsft.model.config import Config
from litsft.model.network import attention
from litsft.model.network.attention import (
    Documents,
    KernelSupport,
    choose_kernel,
    chunked_causal_attention,
    cumulative_lengths,
    document_lengths,
    document_mask,
    documents_of_ids,
    prepare,
    token_document_ids,
    varlen_features,
)
from litsft.model.network.batch import model_inputs
from litsft.model.network.transformer import Transformer, rope_cos_sin
from litsft.training.args import FSDPConfig
from litsft.training.parallel import parallelize

CPU = torch.device("cpu")


def _run_blocks(model, input_ids, position_ids, prepared):
    cos, sin = rope_cos_sin(model.config, position_ids, torch.float32)
    hidden = model.embed(input_ids)
    for block in model.blocks:
        hidden = block(hidden, cos, sin, prepared)
    return model.lm_head(model.norm(hidden))


def test_segmented_attention_equals_the_mask_path():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama"))
    # Two rows joined: documents of 70, 3, 1 and 30 tokens then 24 of padding (its own "document", as in
    # the mask); documents of 100 and 28.
    document_ids = torch.tensor([[0] * 70 + [1] * 3 + [2] + [3] * 30 + [-1] * 24, [0] * 100 + [1] * 28])
    position_ids = torch.cat([torch.arange(n) for n in (70, 3, 1, 30, 24, 100, 28)]).view(1, 256)
    input_ids = torch.randint(0, 512, (1, 256))
    documents = documents_of_ids(document_ids)
    assert document_lengths(documents) == [70, 3, 1, 30, 24, 100, 28]
    results = {}
    for kernel in ("segmented", "mask"):
        model.zero_grad()
        logits = _run_blocks(model, input_ids, position_ids, prepare(kernel, (1, 256), CPU, documents))
        keep = document_ids.view(1, 256) >= 0
        logits[keep].square().mean().backward()
        results[kernel] = (logits.detach(), model.blocks[0].attn.q_proj.weight.grad.clone())
    keep = document_ids.view(1, 256) >= 0
    torch.testing.assert_close(results["segmented"][0][keep], results["mask"][0][keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(results["segmented"][1], results["mask"][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("length", [5, 96, 97, 300])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_chunked_causal_attention_equals_one_call(length, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(3, 4, length, 16, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, length, 16, requires_grad=True) for _ in range(2))
    grad = torch.randn(3, 4, length, 16)
    chunked = chunked_causal_attention(q, k, v, dropout=0.0)
    chunked_grads = torch.autograd.grad(chunked, (q, k, v), grad)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    torch.testing.assert_close(chunked, expected, atol=1e-6, rtol=1e-5)
    for mine, reference in zip(chunked_grads, expected_grads):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [20, 200])
@pytest.mark.parametrize("window", [1, 16, 150])
def test_chunked_causal_attention_with_a_window_equals_the_window_mask(length, window):
    """transformers' sliding window: a query sees the `window` latest keys, itself included."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, length, 16)
    k, v = (torch.randn(2, 2, length, 16) for _ in range(2))
    positions = torch.arange(length)
    mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(chunked_causal_attention(q, k, v, 0.0, window), expected, atol=1e-6, rtol=1e-5)


# ---- the mask kernel and soft-capped attention, a chunk of queries at a time ----------------------------------
def _whole_matrix_mask(document_ids, window):
    """(B or 1, 1, T, T): what the mask kernel built before it ran in chunks, document_ids (B or 1, T)."""
    T = document_ids.shape[1]
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): query - key
    visible = (distance >= 0) & ((distance < window) if window is not None else True)
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & visible)[:, None]


def _whole_matrix_attention(q, k, v, mask, scale, softcap):
    """Attention over the whole (B, H, T, T) scores and mask, as the mask kernel and soft-capped attention ran
    before they ran in chunks -> (B, T, H, D)."""
    H, K = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // K, dim=1) for x in (k, v))
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


CHUNKED_CASES = {
    # documents of unequal lengths crossing the 64-query chunks' boundaries, one-token documents
    "documents": ([70, 3, 1, 150, 40, 1, 55], None),
    "window smaller than the documents": ([70, 3, 1, 150, 40, 1, 55], 9),
    "window larger than the documents": ([70, 3, 1, 150, 40, 1, 55], 100),
    "window larger than the row": ([70, 3, 1, 150, 40, 1, 55], 1000),
    "one document": ([320], 100),
    "causal rows": (None, None),
    "causal rows with a window": (None, 9),
}
"""Documents on the mask kernel; plain causal rows soft-capped only (uncapped, a CPU runs
`chunked_causal_attention`, tested above)."""
HEADS_SCALE_SOFTCAP = [(4, None, None), (2, 0.7, None), (1, None, 0.5), (2, 0.7, 0.5)]


@pytest.mark.parametrize(
    ("case", "kv_heads", "scale", "softcap"),
    [(case, *options) for case in CHUNKED_CASES for options in HEADS_SCALE_SOFTCAP
     if CHUNKED_CASES[case][0] is not None or options[2] is not None],
)  # fmt: skip
def test_chunked_attention_equals_the_whole_matrix(monkeypatch, case, kv_heads, scale, softcap):
    """The mask kernel and soft-capped attention, run 64 queries at a time over the keys each chunk needs,
    give the output and q, k, v gradients of attention over the whole T x T scores and mask (fp32, within
    1e-6 and the rounding of k and v's gradients, summed over the chunks in another order), for packed
    documents and plain causal rows, windows, grouped kv heads, a scale and the soft-cap. Every chunk's keys
    start at its window (the mask kernel plans nothing on the host), and its mask rows cover those keys only:
    no T x T mask or scores."""
    lengths, window = CHUNKED_CASES[case]
    B, H, T, D = (1, 4, sum(lengths), 8) if lengths else (2, 4, 200, 8)
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", B * H * T * 64)  # 64 queries a chunk
    chunks = []
    attend_chunk = attention._attend_chunk

    def recording(q, k, v, start, first, *options):
        chunks.append((start, q.shape[2], first, k.shape[2]))
        return attend_chunk(q, k, v, start, first, *options)

    monkeypatch.setattr(attention, "_attend_chunk", recording)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=generator, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, D, generator=generator, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, T, H, D, generator=generator)
    if lengths:
        documents = Documents(cumulative_lengths(lengths), max(lengths))
        prepared = prepare("mask", (1, T), CPU, documents, window)
        document_ids = token_document_ids(documents, T)[None]
    else:
        prepared, document_ids = (
            prepare("mask", (B, T), CPU, window=window),
            torch.zeros(1, T, dtype=torch.long),
        )
    got = attention.attend(q, k, v, prepared, scale=scale, softcap=softcap)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    expected = _whole_matrix_attention(q, k, v, _whole_matrix_mask(document_ids, window), scale, softcap)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    for name, mine, reference in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(
            mine, reference, atol=1e-6, rtol=5e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    forward, recomputed = chunks[: -(-T // 64)], chunks[-(-T // 64) :]
    assert [(start, size) for start, size, _, _ in forward] == [(a, min(64, T - a)) for a in range(0, T, 64)]
    assert (
        sorted(recomputed) == forward
    )  # each chunk once more in the backward pass, nothing kept but q, k, v
    for start, size, first, keys in forward:
        # The mask kernel reads no boundaries on the host (a GPU would wait): the window alone bounds the keys.
        assert first == max(0, start - window + 1 if window else 0)
        assert first + keys == start + size  # keys [first, end of the chunk)


def _transformers_sink_attention(q, k, v, mask, sinks):
    """transformers' gpt-oss attention (eager_attention_forward, its only path with sinks on a CPU) over the
    whole (B, H, T, S) scores, mask (B or 1, 1, T, S) True where a query may attend -> (B, T, H, D)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return eager_attention_forward(module, q, k, v, additive, scaling=q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("kernel", ["mask", "segmented"])
@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_attention_sinks_in_chunks_equal_transformers(monkeypatch, kernel, case):
    """gpt-oss's sinks (a logit per head in every softmax's denominator) on the written-out path, 64 queries at
    a time, for packed documents (on the mask kernel and on the CPU's segmented one, which gives way to it) and
    plain causal rows, windows, grouped kv heads: transformers' output, and q, k, v and the sinks' gradients,
    within 1e-6 (the gradients within 2e-6, 5e-6 relative: summed over chunks in another order, and transformers
    subtracts each row's maximum first)."""
    lengths, window = CHUNKED_CASES[case]
    B, H, T, D = (1, 4, sum(lengths), 8) if lengths else (2, 4, 200, 8)
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", B * H * T * 64)  # 64 queries a chunk
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=generator, requires_grad=True)
    k, v = (torch.randn(B, 2, T, D, generator=generator, requires_grad=True) for _ in range(2))
    sinks = (2 * torch.randn(H, generator=generator)).requires_grad_()
    grad = torch.randn(B, T, H, D, generator=generator)
    if lengths:
        documents = Documents(cumulative_lengths(lengths), max(lengths))
        prepared = prepare(kernel, (1, T), CPU, documents, window)
        document_ids = token_document_ids(documents, T)[None]
    else:
        prepared = prepare(kernel, (B, T), CPU, window=window)
        document_ids = torch.zeros(1, T, dtype=torch.long)
    got = attention.attend(q, k, v, prepared, sinks=sinks)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    mask = _whole_matrix_mask(document_ids, window)
    expected = _transformers_sink_attention(q, k, v, mask, sinks)
    expected_grads = torch.autograd.grad(expected, (q, k, v, sinks), grad)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    for name, mine, reference in zip(("q", "k", "v", "sinks"), got_grads, expected_grads):
        torch.testing.assert_close(
            mine, reference, atol=2e-6, rtol=5e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    without = attention.attend(q, k, v, prepared)
    assert (without - got).abs().max() > 1e-2  # the sinks take a share of every softmax


def test_attention_sinks_in_decoding_equal_transformers():
    """One new query against a KV cache of 6 slots (4 written): transformers' output for that query."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, length, 8, generator=generator) for heads, length in ((4, 1), (2, 6), (2, 6))
    )
    sinks = 2 * torch.randn(4, generator=generator)
    prepared = prepare("mask", (1, 1), CPU, cache_positions=torch.tensor([3]), cache_length=6)
    got = attention.attend(q, k, v, prepared, sinks=sinks)
    expected = _transformers_sink_attention(
        q, k[:, :, :4], v[:, :, :4], torch.ones(1, 1, 1, 4, dtype=torch.bool), sinks
    )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chosen", ["varlen", "flex", "mask", "segmented"])
def test_a_model_with_attention_sinks_runs_the_written_out_path_on_every_kernel(chosen):
    """No fused kernel takes a sink: whichever kernel is set, gpt-oss runs the mask kernel's written-out path,
    and the start-up line says so."""
    assert attention.kernel_for_sinks(chosen) == "mask"
    model = Transformer(Config.from_name("tiny-gpt-oss"))
    model.attention_kernel = chosen
    assert model.attention_kernel == "mask"
    described = attention.describe_kernel(model.attention_kernel, sinks=True)
    assert "sink" in described and described != attention.KERNEL_DESCRIPTIONS["mask"]


def test_a_chunk_holds_a_bounded_number_of_scores():
    """As many queries as keep a chunk's scores within SCORES_PER_CHUNK, in steps of MIN_QUERY_CHUNK, and
    never fewer than that."""
    step, budget = attention.MIN_QUERY_CHUNK, attention.SCORES_PER_CHUNK
    assert attention.query_chunk(2, 16384) == 1024  # 2 heads over 16k keys: 2^25 scores
    for batch_heads, keys in [(2, 16384), (1, 1000), (3, 5000), (8, 32768)]:
        chunk = attention.query_chunk(batch_heads, keys)
        assert (
            chunk % step == 0 and chunk * batch_heads * keys <= budget < (chunk + step) * batch_heads * keys
        )
    assert attention.query_chunk(32, 131072) == step


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_a_recomputed_chunk_replays_its_dropout(monkeypatch, softcap):
    """While training, the chunks are recomputed in the backward pass: the dropout drawn again there is the
    forward's, so the gradients are those of the output returned (as without recomputation)."""
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 4 * 100 * 32)  # chunks of 64 queries
    lengths = [30, 50, 20]
    prepared = prepare("mask", (1, 100), CPU, Documents(cumulative_lengths(lengths), max(lengths)))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 100, 8, generator=generator, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 100, 4, 8, generator=generator)
    results = []
    for recompute in (True, False):
        if not recompute:  # each chunk kept for the backward pass as it ran
            monkeypatch.setattr(attention, "checkpoint", lambda function, *args, **options: function(*args))
        torch.manual_seed(1)
        out = attention.attend(q, k, v, prepared, dropout=0.5, softcap=softcap)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    no_dropout = attention.attend(q, k, v, prepared, softcap=softcap)
    assert not torch.allclose(results[0][0], no_dropout, atol=1e-2)  # dropout applied
    for name, recomputed, kept in zip(("output", "q", "k", "v"), *results):
        torch.testing.assert_close(
            recomputed, kept, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_chunked_attention_under_torch_compile_equals_eager_and_does_not_recompile(monkeypatch):
    """Compiled as GPU runs compile the blocks (dynamic shapes), the chunked path runs eagerly behind a graph
    break: the same output and gradients as eager, and new document layouts and lengths (other chunk counts)
    compile nothing new."""
    import torch._dynamo

    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 4 * 64 * 64)  # 64 queries a chunk at 64 tokens
    torch._dynamo.reset()

    def layer(q, k, v, prepared):
        return attention.attend(q * 2.0, k, v, prepared, scale=0.7, softcap=0.5).square()

    compiled = torch.compile(layer, dynamic=True)
    for index, lengths in enumerate([[100, 56, 100], [30, 200, 70], [300], [7, 8, 9, 200, 76, 100]]):
        N = sum(lengths)
        generator = torch.Generator().manual_seed(index)
        q = torch.randn(1, 4, N, 8, generator=generator, requires_grad=True)
        k, v = torch.randn(1, 2, N, 8, generator=generator), torch.randn(1, 2, N, 8, generator=generator)
        prepared = prepare("mask", (1, N), CPU, Documents(cumulative_lengths(lengths), max(lengths)), 40)
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            got = compiled(q, k, v, prepared)
            (got_grad,) = torch.autograd.grad(got.sum(), q)
        expected = layer(q, k, v, prepared)
        (expected_grad,) = torch.autograd.grad(expected.sum(), q)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-6, rtol=0)
    torch._dynamo.reset()


# ---- document boundaries built by the data loader ------------------------------------------------------------
def test_collate_builds_the_boundaries_of_the_joined_real_tokens():
    """cu_seqlens/max_seqlen describe the rows' real tokens joined in order (padding in no document), and are
    the boundaries the model would find from the document ids of the joined row."""
    lengths = [9, 4, 2, 12, 6, 1 + 1]  # a sample of n tokens fills n - 1 positions
    tokens = np.arange(sum(lengths)) % 50 + 1
    samples = Samples.back_to_back(
        np.asarray(tokens, dtype=np.int64), np.ones(sum(lengths), dtype=bool), lengths
    )
    batch = collate(samples, [[0, 1, 2], [3, 4, 5]], seq_length=20, pad_id=0)
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 8, 11, 12, 23, 28, 29]
    assert int(batch["max_seqlen"]) == 11
    inputs = model_inputs(batch)
    assert inputs["input_ids"].shape == (1, 29)  # the 11 padding positions are gone
    joined_ids = torch.repeat_interleave(torch.arange(6), torch.tensor([8, 3, 1, 11, 5, 1]))[None]
    found = documents_of_ids(joined_ids)
    assert torch.equal(found.cu_seqlens, inputs["documents"].cu_seqlens)
    assert found.max_seqlen == inputs["documents"].max_seqlen
    assert torch.equal(token_document_ids(inputs["documents"], 29), joined_ids[0])
    assert torch.equal(inputs["input_ids"][0], batch["input_ids"][batch["document_ids"] >= 0])
    labels = inputs["labels"].flatten()
    assert torch.equal(inputs["loss_positions"], (labels != -100).nonzero().flatten())


def test_cumulative_lengths():
    assert cumulative_lengths([3, 1, 5]).tolist() == [0, 3, 4, 9]
    assert cumulative_lengths([]).tolist() == [0]


# ---- the kernel choice -------------------------------------------------------------------------------------
ALL_VARLEN = frozenset({"enable_gqa", "window_size", "scale"})  # torch 2.12 and newer
TORCH_2_11_VARLEN = frozenset({"window_size", "scale"})  # no enable_gqa
TORCH_2_10_VARLEN = frozenset({"is_causal"})  # no window_size, no enable_gqa, no scale


H100, A100, T4, V100, P100 = (9, 0), (8, 0), (7, 5), (7, 0), (6, 0)


@pytest.mark.parametrize(
    ("device", "dtype", "windowed", "dropout", "varlen", "flex", "capability", "expected"),
    [
        ("cpu", torch.bfloat16, False, 0.0, ALL_VARLEN, True, H100, "segmented"),
        ("cuda", torch.bfloat16, False, 0.0, ALL_VARLEN, True, H100, "varlen"),
        ("cuda", torch.bfloat16, False, 0.0, TORCH_2_11_VARLEN, True, H100, "varlen"),  # kv heads repeated
        ("cuda", torch.bfloat16, True, 0.0, TORCH_2_11_VARLEN, True, H100, "varlen"),
        ("cuda", torch.bfloat16, False, 0.0, TORCH_2_10_VARLEN, True, H100, "varlen"),
        ("cuda", torch.float16, True, 0.0, ALL_VARLEN, True, H100, "varlen"),
        ("cuda", torch.bfloat16, True, 0.0, TORCH_2_10_VARLEN, True, H100, "flex"),  # no window in varlen
        ("cuda", torch.float32, False, 0.0, ALL_VARLEN, True, H100, "flex"),  # flash needs 16-bit inputs
        ("cuda", torch.bfloat16, False, 0.0, None, True, H100, "flex"),  # no torch.nn.attention.varlen
        ("cuda", torch.bfloat16, False, 0.0, None, False, H100, "mask"),
        ("cuda", torch.bfloat16, True, 0.0, TORCH_2_10_VARLEN, False, H100, "mask"),
        ("cuda", torch.bfloat16, False, 0.1, ALL_VARLEN, True, H100, "mask"),  # only SDPA applies dropout
        ("mps", torch.float32, False, 0.0, None, False, H100, "mask"),
        # flash attention runs on sm80 to sm121 only, Triton (flex) on sm70 and newer
        ("cuda", torch.bfloat16, False, 0.0, ALL_VARLEN, True, A100, "varlen"),
        ("cuda", torch.bfloat16, False, 0.0, ALL_VARLEN, True, (12, 0), "varlen"),  # Blackwell, RTX 50xx
        ("cuda", torch.bfloat16, False, 0.0, ALL_VARLEN, True, (13, 0), "flex"),  # past torch's flash build
        ("cuda", torch.float16, False, 0.0, ALL_VARLEN, True, T4, "flex"),
        ("cuda", torch.float16, True, 0.0, ALL_VARLEN, True, V100, "flex"),
        ("cuda", torch.float16, False, 0.0, ALL_VARLEN, False, T4, "mask"),
        ("cuda", torch.float32, False, 0.0, ALL_VARLEN, True, P100, "mask"),
    ],
)
def test_choose_kernel(device, dtype, windowed, dropout, varlen, flex, capability, expected):
    assert (
        choose_kernel(device, dtype, windowed, dropout, KernelSupport(varlen, flex, capability)) == expected
    )


def test_varlen_features_come_from_the_signature():
    assert varlen_features(varlen_2_10) == TORCH_2_10_VARLEN
    assert varlen_features(varlen_2_11) == TORCH_2_11_VARLEN
    assert varlen_features(varlen_2_13) == ALL_VARLEN


@pytest.mark.parametrize(
    ("chosen", "flex", "expected"),
    [("varlen", True, "flex"), ("varlen", False, "mask"), ("flex", True, "flex"), ("segmented", False, "mask"),
     ("mask", False, "mask")],
)  # fmt: skip
def test_a_soft_capped_model_runs_a_kernel_that_can_cap(chosen, flex, expected, monkeypatch):
    """Gemma 2 caps its attention logits: varlen's flash kernel and the CPU's per-document SDPA cannot, so setting them
    sets flex (its score_mod caps) where torch has it, else the mask kernel (scores written out); the
    kernel the engine logs is then the one that runs. A model without a cap keeps what it is given."""
    support = KernelSupport(frozenset(), flex, (9, 0))
    monkeypatch.setattr(KernelSupport, "installed", classmethod(lambda cls: support))
    assert attention.kernel_for_softcap(chosen) == expected
    capped, plain = Transformer(Config.from_name("tiny-gemma2")), Transformer(Config.from_name("tiny-llama"))
    capped.attention_kernel = plain.attention_kernel = chosen
    assert (capped.attention_kernel, plain.attention_kernel) == (expected, chosen)


@pytest.mark.parametrize("chosen", ["varlen", "flex", "mask", "segmented"])
def test_the_start_up_line_names_the_soft_capped_path_that_runs(chosen, monkeypatch):
    """Gemma 2 on a CPU runs the mask kernel's soft-capped path, which writes the scores out; its description
    is that path, not the SDPA call an uncapped model runs under the same kernel name."""
    monkeypatch.setattr(
        KernelSupport, "installed", classmethod(lambda cls: KernelSupport(frozenset(), True, (9, 0)))
    )
    model = Transformer(Config.from_name("tiny-gemma2"))
    model.attention_kernel = chosen
    described = attention.describe_kernel(model.attention_kernel, softcapped=True)
    assert "soft-cap" in described and "scaled_dot_product_attention" not in described
    assert attention.describe_kernel("mask") == attention.KERNEL_DESCRIPTIONS["mask"]


def test_the_model_chooses_a_kernel_at_its_first_forward_when_none_was_set():
    model = Transformer(Config.from_name("tiny-llama"))
    assert model.attention_kernel is None
    model(torch.randint(0, 512, (1, 8)), document_ids=torch.zeros(1, 8, dtype=torch.long))
    assert model.attention_kernel == "segmented"


# ---- the varlen glue, on the CPU, with a reference varlen_attn ------------------------------------------------
def _document_probabilities(q, k, left, gqa):
    """Softmax scores (H, L, L) of one document, in fp32, and k repeated to q's heads."""
    if gqa:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    L = q.shape[1]
    positions = torch.arange(L)
    mask = positions[None, :] <= positions[:, None]
    if left >= 0:
        mask &= positions[None, :] >= positions[:, None] - left
    scores = (q.float() @ k.float().transpose(1, 2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1), k


def _documents(cu):
    return zip(cu[:-1].tolist(), cu[1:].tolist())


def _reference_varlen(q, k, v, cu, max_len, left, gqa):
    """flash-attention semantics per document: causal, `left` keys left of the query (-1: all)."""
    out = torch.empty_like(q)
    for start, end in _documents(cu):
        assert end - start <= max_len
        qd, kd, vd = (x[start:end].transpose(0, 1) for x in (q, k, v))  # (H or K, L, D)
        probabilities, _ = _document_probabilities(qd, kd, left, gqa)
        vd = vd.repeat_interleave(qd.shape[0] // vd.shape[0], dim=0) if gqa else vd
        out[start:end] = (probabilities @ vd.float()).transpose(0, 1).to(q.dtype)
    return out


def _reference_varlen_backward(grad, q, k, v, cu, left, gqa):
    """The gradients of `_reference_varlen`, written out (a custom op's body runs without autograd)."""
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    group = q.shape[1] // k.shape[1] if gqa else 1
    for start, end in _documents(cu):
        qd, kd, vd, gd = (x[start:end].transpose(0, 1).float() for x in (q, k, v, grad))
        p, k_full = _document_probabilities(qd, kd, left, gqa)
        v_full = vd.repeat_interleave(group, dim=0)
        dv_full = p.transpose(1, 2) @ gd  # (H, L, D)
        dp = gd @ v_full.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / qd.shape[-1] ** 0.5
        dq[start:end] = (ds @ k_full).transpose(0, 1)
        dk_full, dv_full = ds.transpose(1, 2) @ qd, dv_full
        H, L, D = dk_full.shape
        dk[start:end] = dk_full.view(H // group, group, L, D).sum(1).transpose(0, 1)
        dv[start:end] = dv_full.view(H // group, group, L, D).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("litsft_test::varlen", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, left: int, gqa: bool
) -> torch.Tensor:
    return _reference_varlen(q, k, v, cu, max_len, left, gqa)


@_varlen_op.register_fake
def _(q, k, v, cu, max_len, left, gqa):
    return torch.empty_like(q)


@torch.library.custom_op("litsft_test::varlen_backward", mutates_args=())
def _varlen_backward_op(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
    left: int, gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _reference_varlen_backward(grad, q, k, v, cu, left, gqa)


@_varlen_backward_op.register_fake
def _(grad, q, k, v, cu, max_len, left, gqa):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


_varlen_op.register_autograd(
    lambda ctx, grad: (*_varlen_backward_op(grad, *ctx.saved_tensors, *ctx.options), None, None, None, None),
    setup_context=_setup_context,
)


def varlen_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch 2.13's signature: windows, grouped kv heads and a scale."""
    assert query.dtype in (torch.bfloat16, torch.float16) and window_size[1] == 0
    if scale is not None:  # the same scores under the default 1/sqrt(D)
        query = query * (scale * query.shape[-1] ** 0.5)
    if not enable_gqa:
        assert query.shape[1] == key.shape[1]
    return _varlen_op(query, key, value, cu_seq_q, max_q, window_size[0], enable_gqa)


def varlen_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11.0's signature (torch/nn/attention/varlen.py of its wheel): a window and a scale, no
    enable_gqa; causal when window_size == (-1, 0), as its body decides."""
    assert query.dtype in (torch.bfloat16, torch.float16) and window_size[1] == 0
    assert window_size == (-1, 0) or window_size[0] >= 0
    assert query.shape[1] == key.shape[1], "torch 2.11's varlen_attn has no enable_gqa"
    if scale is not None:
        query = query * (scale * query.shape[-1] ** 0.5)
    return _varlen_op(query, key, value, cu_seq_q, max_q, window_size[0], False)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10.0's signature: causal or not, no window, no scale, no enable_gqa."""
    assert query.dtype in (torch.bfloat16, torch.float16) and is_causal
    assert query.shape[1] == key.shape[1], "torch 2.10's varlen_attn has no enable_gqa"
    return _varlen_op(query, key, value, cu_seq_q, max_q, -1, False)


def _packed_batch(seed: int, row_lengths: list[list[int]], seq_length: int = 48):
    """A collated packed batch with documents of these lengths per row, then padding."""
    generator = np.random.default_rng(seed)
    lengths = [n + 1 for row in row_lengths for n in row]
    tokens = generator.integers(1, 512, sum(lengths))
    targets = generator.random(sum(lengths)) > 0.2
    samples = Samples.back_to_back(tokens.astype(np.int64), targets, lengths)
    rows, index = [], 0
    for row in row_lengths:
        rows.append(list(range(index, index + len(row))))
        index += len(row)
    return collate(samples, rows, seq_length=seq_length, pad_id=0)


# Several documents, one-token documents, end-of-row padding, two rows.
ROWS = [[20, 1, 9, 1, 6], [1, 30, 3]]


def _loss_and_grads(model, batch, kernel, autocast_dtype=None):
    model.zero_grad()
    model.attention_kernel = kernel
    device = next(model.parameters()).device
    inputs = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value.to(device)
        for name, value in model_inputs(batch).items()
    }
    with torch.autocast(device.type, autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        hidden = model.hidden_states(inputs["input_ids"], inputs["position_ids"], inputs["documents"])
        logits = model.lm_head(hidden).float()[0]
    per_token = F.cross_entropy(logits, inputs["labels"][0], reduction="none")  # (N,), 0 where no target
    per_token.sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(mine, reference, atol, rtol):
    torch.testing.assert_close(mine[0], reference[0], atol=atol, rtol=rtol)
    for name in reference[1]:
        torch.testing.assert_close(mine[1][name], reference[1][name], atol=atol, rtol=rtol, msg=name)


# torch 2.10's varlen_attn takes no window: choose_kernel picks flex for windows there (tested above).
@pytest.mark.parametrize(
    ("varlen", "window"),
    [(varlen_2_13, None), (varlen_2_13, 8), (varlen_2_11, None), (varlen_2_11, 8), (varlen_2_10, None)],
)
def test_varlen_glue_equals_the_mask_path_on_the_cpu(monkeypatch, varlen, window):
    """The varlen kernel's glue (bf16 inputs, (N, H, D) layout, GQA by repeating kv heads where varlen_attn
    has no enable_gqa, flash's window convention) against the mask path, through a reference varlen_attn."""
    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama", sliding_window=window))
    batch = _packed_batch(0, ROWS)
    expected = _loss_and_grads(model, batch, "mask", torch.bfloat16)
    _assert_same(_loss_and_grads(model, batch, "varlen", torch.bfloat16), expected, atol=2e-2, rtol=2e-2)
    # The reference runs in bf16 like flash; against fp32 the mask path differs by bf16 rounding only.
    fp32 = _loss_and_grads(model, batch, "mask")
    _assert_same(expected, fp32, atol=5e-2, rtol=5e-2)


def test_flex_glue_equals_the_mask_path_on_the_cpu(monkeypatch):
    """flex_attention's document block mask (and window) in the forward pass; its backward needs a GPU."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_attention)
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama", sliding_window=8)).eval()
    inputs = model_inputs(_packed_batch(1, ROWS))
    args = (inputs["input_ids"], inputs["position_ids"], inputs["documents"])
    with torch.no_grad():
        model.attention_kernel = "mask"
        expected = model.hidden_states(*args)
        model.attention_kernel = "flex"
        torch.testing.assert_close(model.hidden_states(*args), expected, atol=1e-5, rtol=1e-5)


def _dense_blocks(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(query blocks, key blocks) booleans from a BlockMask's per-row counts and indices."""
    counts, indices = num_blocks[0, 0], indices[0, 0]
    dense = torch.zeros(counts.shape[0], indices.shape[-1], dtype=torch.bool)
    for row, count in enumerate(counts.tolist()):
        dense[row, indices[row, :count].long()] = True
    return dense


@pytest.mark.parametrize(
    "lengths",
    [
        [100, 1, 200, 30],  # 331 tokens: a last block of 75
        [600],  # one document over several blocks: full blocks below the diagonal
        [128, 128, 1, 127, 256],  # boundaries on block edges, a one-token document
        [1] * 70 + [300, 5, 400],
    ],
)
@pytest.mark.parametrize("window", [None, 8, 200])
def test_flex_block_mask_from_the_documents_equals_create_block_mask(lengths, window):
    """The block mask built from the documents' block layout ((N/128)^2 work) has the same partial and full
    blocks as create_block_mask's evaluation of every position, and gives flex_attention the same output
    as the boolean mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    N = sum(lengths)
    document_ids = token_document_ids(Documents(cumulative_lengths(lengths), max(lengths)), N)
    mine = attention._document_block_mask(document_ids, window)

    def document_causal(batch, head, query, key):
        visible = (document_ids[query] == document_ids[key]) & (query >= key)
        return visible & (query - key < window) if window is not None else visible

    reference = create_block_mask(document_causal, None, None, N, N, device="cpu")
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(
            _dense_blocks(getattr(mine, counts), getattr(mine, indices)),
            _dense_blocks(getattr(reference, counts), getattr(reference, indices)),
        ), counts
    q, k, v = torch.randn(3, 1, 2, N, 16, generator=torch.Generator().manual_seed(0))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, window))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mine), expected, atol=1e-5, rtol=1e-5)


def test_new_document_layouts_do_not_recompile(monkeypatch):
    """Compiled as the engine compiles them (`parallelize`), blocks fed a new document layout every step (other
    boundaries, another number of documents, another longest one, another number of real tokens) compile once."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen_2_13)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    model.attention_kernel = "varlen"
    parallelize(model, None, FSDPConfig(), "bf16-mixed", compile_blocks=True)
    layouts = [[[20, 1, 9, 1, 6], [1, 30, 3]], [[40], [12, 12]], [[5, 5, 5, 5, 5, 5, 5], [47]], [[3], [2, 2]]]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, rows in enumerate(layouts):
            batch = _packed_batch(seed, rows)
            inputs = model_inputs(batch)
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(**inputs)
            loss.backward()
    assert not counters["graph_break"], dict(
        counters["graph_break"]
    )  # each block is one graph, attention included
    torch._dynamo.reset()


# ---- the real flash kernels, on a GPU ------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(),
    reason="varlen_attn and flex_attention's backward run on CUDA GPUs only; a CPU machine checks their glue above",
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", ["varlen", "flex"])
@pytest.mark.parametrize("window", [None, 8])
def test_flash_kernels_equal_the_mask_path_on_a_gpu(kernel, window):
    """Per-token loss and every gradient of the flash kernels equal the boolean-mask path within bf16
    tolerance: packed rows with GQA, several documents, one-token documents, end-of-row padding."""
    features = varlen_features(attention._varlen_attn()) if attention._varlen_attn() else None
    if kernel == "varlen" and (features is None or (window is not None and "window_size" not in features)):
        pytest.skip("this torch's varlen_attn cannot take this case; choose_kernel picks flex for it")
    torch.manual_seed(0)
    config = Config.from_name(
        "tiny-llama", sliding_window=window, num_heads=8, num_kv_heads=2, hidden_size=256
    )
    model = Transformer(config).cuda()
    batch = _packed_batch(0, ROWS)
    expected = _loss_and_grads(model, batch, "mask", torch.bfloat16)
    _assert_same(_loss_and_grads(model, batch, kernel, torch.bfloat16), expected, atol=2e-2, rtol=2e-2)


def _reference_attention(q, k, v, lengths, window, scale, softcap):
    """Written out one document at a time: q (1, H, N, D), k, v (1, K, N, D) -> (1, N, H, D)."""
    H, K = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // K, dim=1) for x in (k, v))
    outputs, start = [], 0
    for length in lengths:
        doc = slice(start, start + length)
        scores = q[0, :, doc] @ k[0, :, doc].transpose(-2, -1) * scale  # (H, L, L)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
        visible = (key <= query) & ((query - key < window) if window is not None else True)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append((weights @ v[0, :, doc]).transpose(0, 1))  # (L, H, D)
        start += length
    return torch.cat(outputs)[None]


@pytest.mark.parametrize("kernel", ["segmented", "mask", "varlen", "flex"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_scale_and_softcap_on_every_kernel_equal_attention_written_out(monkeypatch, kernel, window, softcap):
    """An explicit scale (not 1/sqrt(D)) and Gemma 2's logit soft-cap, on packed documents and on plain rows:
    the same numbers from every kernel (varlen routes soft-capped layers to the mask path; flex applies the
    cap in score_mod), as attention written out document by document."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen_2_13)
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_attention)
    torch.manual_seed(0)
    lengths, scale = [9, 1, 14], 0.7  # scores of this size: the cap changes them
    N = sum(lengths)
    q, k, v = torch.randn(1, 4, N, 8), torch.randn(1, 2, N, 8), torch.randn(1, 2, N, 8)
    expected = _reference_attention(q, k, v, lengths, window, scale, softcap)
    documents = Documents(cumulative_lengths(lengths), max(lengths))
    prepared = prepare(kernel, (1, N), CPU, documents, window)
    bf16 = kernel == "varlen"  # flash kernels run in 16 bits: under autocast, as in training
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        got = attention.attend(q, k, v, prepared, scale=scale, softcap=softcap)
    torch.testing.assert_close(got.float(), expected, atol=5e-2 if bf16 else 1e-5, rtol=0)
    # Plain rows (B, T): each row one sequence.
    rows = prepare(kernel, (2, 7), CPU, window=window)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        got = attention.attend(q, k, v, rows, scale=scale, softcap=softcap).float()
    for row in range(2):
        row_expected = _reference_attention(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], [7], window, scale, softcap
        )
        torch.testing.assert_close(got[row : row + 1], row_expected, atol=5e-2 if bf16 else 1e-5, rtol=0)


@pytest.mark.parametrize("varlen", [varlen_2_10, varlen_2_11])
def test_an_explicit_scale_reaches_a_varlen_attn_with_or_without_a_scale_argument(monkeypatch, varlen):
    """torch 2.10's varlen_attn takes no scale: the glue scales the queries instead (torch 2.11's takes it)."""
    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    torch.manual_seed(0)
    lengths, scale = [9, 1, 14], 0.7
    q, k, v = torch.randn(1, 4, 24, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    prepared = prepare("varlen", (1, 24), CPU, Documents(cumulative_lengths(lengths), max(lengths)))
    with torch.autocast("cpu", torch.bfloat16):
        got = attention.attend(q, k, v, prepared, scale=scale)
    expected = _reference_attention(q, k, v, lengths, None, scale, None)
    torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=0)


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_scale_and_softcap_in_decoding(softcap):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    prepared = prepare("mask", (1, 1), CPU, cache_positions=torch.tensor([3]), cache_length=6)
    got = attention.attend(q, k, v, prepared, scale=0.7, softcap=softcap)
    full_q = torch.cat([torch.zeros(1, 4, 3, 8), q, torch.zeros(1, 4, 2, 8)], dim=2)
    expected = _reference_attention(full_q, k, v, [6], None, 0.7, softcap)[:, 3:4]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
