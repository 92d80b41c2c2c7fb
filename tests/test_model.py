"""litsft/model.py: the CPU per-document attention for packed batches against the boolean-mask path, the loss
over labelled positions, RMSNorm, chunked causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from litsft.config import Config
from litsft.model import (
    RMSNorm,
    Transformer,
    attention_mask,
    chunked_causal_attention,
    document_segments,
    rope_cos_sin,
)


def test_segmented_attention_equals_the_mask_path():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama"))
    # Two rows: documents of 70, 3, 1 and 30 tokens then 24 of padding (its own "document", as in the
    # mask); documents of 100 and 28.
    document_ids = torch.tensor([[0] * 70 + [1] * 3 + [2] + [3] * 30 + [-1] * 24, [0] * 100 + [1] * 28])
    position_ids = torch.cat([torch.arange(n) for n in (70, 3, 1, 30, 24, 100, 28)]).view(2, 128)
    input_ids = torch.randint(0, 512, (2, 128))
    segments = document_segments(document_ids)
    assert [g.shape[1] for g in segments.gather] == [100, 70, 30]  # 30, 28, 24, 3, 1 share a bucket
    cos, sin = rope_cos_sin(model.config, position_ids, torch.float32)
    results = {}
    for name, mask in (("segments", segments), ("mask", attention_mask(document_ids))):
        model.zero_grad()
        hidden = model.embed(input_ids)
        for block in model.blocks:
            hidden = block(hidden, cos, sin, mask)
        logits = model.lm_head(model.norm(hidden))
        logits[document_ids >= 0].square().mean().backward()
        results[name] = (logits.detach(), model.blocks[0].attn.q_proj.weight.grad.clone())
    keep = document_ids >= 0
    torch.testing.assert_close(results["segments"][0][keep], results["mask"][0][keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(results["segments"][1], results["mask"][1], atol=1e-5, rtol=1e-4)


def test_loss_runs_the_head_on_labelled_positions_only_and_matches_the_full_logits():
    """The loss skips the output head where labels are -100; value and gradients are those of the full logits."""
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    input_ids = torch.randint(0, 512, (2, 40))
    labels = torch.randint(0, 512, (2, 40))
    labels[0, :25] = -100  # a masked prompt
    labels[1, 30:] = -100  # padding
    logits = model(input_ids)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    for positions in (None, (labels.flatten() != -100).nonzero().flatten()):
        model.zero_grad()
        loss = model(input_ids, labels=labels, loss_positions=positions)
        loss.backward()
        torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
        for param, grad in zip(model.parameters(), expected_grads):
            torch.testing.assert_close(param.grad, grad, atol=1e-6, rtol=1e-4)
    nothing_to_learn = model(input_ids, labels=torch.full_like(labels, -100))
    assert nothing_to_learn.item() == 0.0


def test_rms_norm_is_the_written_out_formula_bit_for_bit():
    """The fused F.rms_norm in RMSNorm gives what HF's x * rsqrt(mean(x^2) + eps), cast, times weight gives."""
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 17, 96).to(dtype) * 5
        x32 = x.float()
        expected = norm.weight.to(dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            dtype
        )
        assert torch.equal(norm.to(dtype)(x), expected)
        norm.float()


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


def test_packed_loss_without_padding_equals_documents_one_by_one():
    """The CPU loss drops row padding and joins the rows into one: still no attention across documents, even
    between a row's last document and the next row's first (both have id 0 here, with only padding between)."""
    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    documents = [[20], [10, 15]]  # document lengths per row of 32 tokens
    input_ids = torch.randint(0, 512, (2, 32))
    labels = torch.randint(0, 512, (2, 32))
    labels[:, :3] = -100
    document_ids = torch.full((2, 32), -1)
    position_ids = torch.zeros(2, 32, dtype=torch.long)
    spans = []
    for row, lengths in enumerate(documents):
        start = 0
        for doc, length in enumerate(lengths):
            document_ids[row, start : start + length] = doc
            position_ids[row, start : start + length] = torch.arange(length)
            spans.append((row, start, start + length))
            start += length
    labels[document_ids < 0] = -100
    loss = model(input_ids, position_ids, document_ids, labels=labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = sum(model(input_ids[r, a:b][None], labels=labels[r, a:b][None]) for r, a, b in spans)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-4)
    # A batch of padding only (validation fills ranks up with empty rows) has nothing to learn.
    nothing = model(
        input_ids, position_ids, torch.full_like(document_ids, -1), labels=torch.full_like(labels, -100)
    )
    assert nothing.item() == 0.0
