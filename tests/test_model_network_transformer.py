"""litsft/model/network/transformer.py: the loss over labelled positions, RMSNorm, packed rows against documents one by one, and
Mistral's and Qwen2's sliding windows against transformers (every attention path, KV-cache decoding too).
The attention kernels themselves are tested in tests/test_model_network_attention.py."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import (
    PHI3_LONG_ROPE_LENGTH,
    SLIDING_WINDOW,
    assert_logits_match_transformers,
    save_tiny_hf,
    tiny_hf_model,
)

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf
from litsft.inference.generate import generate_batch, generate_tokens
from litsft.model.config import Config
from litsft.model.network.transformer import RMSNorm, Transformer


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2", "tiny-granite"])
def test_loss_runs_the_head_on_labelled_positions_only_and_matches_the_full_logits(name):
    """The loss skips the output head where labels are -100; value and gradients are those of the full logits,
    soft-capped (Gemma 2) or scaled (Granite) alike."""
    torch.manual_seed(0)
    model = Transformer(Config.from_name(name))
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


def test_per_sequence_losses_are_each_documents_or_rows_alone_packed_and_unpacked():
    """`per_sequence`: one summed cross-entropy per sequence, from packed documents (through model_inputs, as the
    engine passes them) and from right-padded unpacked rows alike, each equal to that sequence run alone;
    their gradients are those of the sequences alone too."""
    from litsft.model.network.batch import model_inputs

    torch.manual_seed(0)
    model = Transformer(Config.from_name("tiny-llama"))
    lengths = [7, 12, 5]
    ids = [torch.randint(0, 512, (n,)) for n in lengths]
    labels = [torch.randint(0, 512, (n,)) for n in lengths]
    for label in labels:
        label[:2] = -100  # a masked prompt
    alone = torch.stack([model(i[None], labels=y[None]) for i, y in zip(ids, labels)])
    weights = torch.tensor([1.0, -2.0, 3.0])
    expected_grads = torch.autograd.grad((alone * weights).sum(), list(model.parameters()))
    packed = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "document_ids": torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None],
    }
    width = max(lengths)
    unpacked = {
        "input_ids": torch.stack([torch.nn.functional.pad(i, (0, width - len(i))) for i in ids]),
        "labels": torch.stack([torch.nn.functional.pad(y, (0, width - len(y)), value=-100) for y in labels]),
    }
    for batch in (model_inputs(packed), model_inputs(unpacked)):
        sums = model(**batch, per_sequence=True)
        assert sums.shape == (3,)
        torch.testing.assert_close(sums, alone.detach(), atol=1e-4, rtol=1e-5)
        grads = torch.autograd.grad((sums * weights).sum(), list(model.parameters()))
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)


# ---- sliding windows ------------------------------------------------------------------------------------
LENGTH = 2 * SLIDING_WINDOW + 8  # past twice the window


def _converted(tmp_path, kind, attention_sharpness=1.0):
    """A tiny transformers model and the litsft model converted from it; `attention_sharpness` scales the query
    and key weights, so that attention (and so RoPE) decides more of the logits than in a fresh model."""
    hf_model = tiny_hf_model(kind)
    config = hf_model.config
    query_and_key_rows = (config.num_attention_heads + config.num_key_value_heads) * (
        config.hidden_size // config.num_attention_heads
    )
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("qkv_proj.weight"):  # Phi-3's q, k and v, in this order
                param[:query_and_key_rows] *= attention_sharpness
    convert_from_hf(save_tiny_hf(hf_model, tmp_path / "hf"), tmp_path / "litsft")
    model = Transformer(Config.from_checkpoint(tmp_path / "litsft")).eval()
    model.load_state_dict(load_model_state_dict(tmp_path / "litsft"))
    return hf_model, model


@pytest.mark.parametrize(
    ("kind", "windowed_layers"),
    [("mistral-window", [0, 1]), ("qwen2-window", [1]), ("qwen2-window-first", [0]), ("phi3", [0, 1])],
)
@pytest.mark.parametrize("kernel", ["segmented", "mask"])
def test_sliding_window_matches_transformers(tmp_path, kind, windowed_layers, kernel):
    """Mistral's sliding_window on every layer, Qwen2's on the layers layer_types names: logits equal transformers'
    at twice the window, for plain rows and for the same sequences packed as documents of one row."""
    hf_model, model = _converted(tmp_path, kind)
    config = model.config
    assert [i for i in range(config.num_layers) if config.attention_window(i)] == windowed_layers
    assert config.sliding_window == SLIDING_WINDOW
    model.attention_kernel = kernel
    tokens = torch.randint(0, 512, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    expected = assert_logits_match_transformers(model, hf_model, tokens)
    with torch.no_grad():
        # Attending past the window gives other logits: the test reaches past it.
        config.sliding_window = None
        assert (model(tokens) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["mistral-window", "qwen2-window", "phi3"])
def test_sliding_window_in_kv_cache_decoding(tmp_path, kind):
    """Decoding one token at a time against the KV cache keeps the window: each step's logits are the full
    forward's at that position, up to twice the window, and greedy tokens are transformers' own."""
    hf_model, model = _converted(tmp_path, kind)
    prompt = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(1))
    new_tokens = generate_tokens(model, prompt, max_new_tokens=LENGTH - 5)
    with torch.no_grad():
        expected = hf_model.generate(
            prompt[None], max_new_tokens=LENGTH - 5, do_sample=False, min_new_tokens=LENGTH - 5
        )[0, 5:]
    assert new_tokens.tolist() == expected.tolist()


# ---- Phi-3 / Phi-4: fused weights, partial rotary, LongRoPE -----------------------------------------------
PHI_LENGTH = 2 * PHI3_LONG_ROPE_LENGTH  # past LongRoPE's switch to its long factors


@pytest.mark.parametrize("kind", ["phi3", "phi3-longrope"])
def test_phi_logits_match_transformers_alone_and_packed(tmp_path, kind):
    """64 tokens (LongRoPE's long factors), 20 tokens (its short ones), and both packed in one row: each
    document is rotated by its own length, so packed logits are each document's logits alone, and those are
    transformers'."""
    hf_model, model = _converted(tmp_path, kind)
    generator = torch.Generator().manual_seed(0)
    long, short = torch.randint(0, 512, (2, PHI_LENGTH), generator=generator), torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        expected_long, expected_short = hf_model(long).logits, hf_model(short).logits
        assert (model(long) - expected_long).abs().max() < 1e-4
        assert (model(short) - expected_short).abs().max() < 1e-4
        row = torch.cat((long[0], short[0], long[1]))[None]
        document_ids = torch.tensor([0] * PHI_LENGTH + [1] * 20 + [2] * PHI_LENGTH)[None]
        positions = torch.cat([torch.arange(n) for n in (PHI_LENGTH, 20, PHI_LENGTH)])[None]
        for kernel in ("segmented", "mask"):
            model.attention_kernel = kernel
            packed = model(row, positions, document_ids)[0]
            expected = torch.cat((expected_long[0], expected_short[0], expected_long[1]))
            assert (packed - expected).abs().max() < 1e-4, kernel
        if kind == "phi3-longrope":  # the long factors and the attention scaling were in use
            model.config.rope_scaling["original_max_position_embeddings"] = PHI_LENGTH
            assert (model(long) - expected_long).abs().max() > 1e-3


def test_phi_greedy_generation_across_the_long_rope_switch_equals_transformers(tmp_path):
    """From a 5-token prompt to 64 tokens, past LongRoPE's switch at 32 where transformers computes the cache
    again: every step's logits and the greedy tokens of generate_tokens, and the batched generate_batch's
    tokens, are transformers'."""
    hf_model, model = _converted(tmp_path, "phi3-longrope", attention_sharpness=8.0)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    steps = []
    model.register_forward_hook(lambda module, args, output: steps.append(output[0, -1]))
    expected = []
    for prompt in prompts:
        new = PHI_LENGTH - len(prompt)
        with torch.no_grad():
            hf = hf_model.generate(prompt[None], max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                   output_logits=True, return_dict_in_generate=True)  # fmt: skip
        expected.append(hf.sequences[0, len(prompt) :].tolist())
        steps.clear()
        assert generate_tokens(model, prompt, max_new_tokens=new).tolist() == expected[-1]
        assert max((a - b[0]).abs().max().item() for a, b in zip(steps, hf.logits)) < 1e-4
    batched = generate_batch(model, [p.tolist() for p in prompts], max_new_tokens=PHI_LENGTH - 9)
    assert batched == [tokens[: PHI_LENGTH - 9] for tokens in expected]


@pytest.mark.parametrize(
    "rope_scaling",
    [
        # gpt-oss's own (not truncated), at its published shape
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        # transformers' defaults: truncated ramp ends, beta 32 and 1
        {"factor": 4.0, "original_max_position_embeddings": 2048},
        # DeepSeek's mscale ratio, and an explicit attention factor
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096},
        {"factor": 8.0, "attention_factor": 1.3, "beta_fast": 16.0, "original_max_position_embeddings": 1024},
    ],
)
def test_yarn_frequencies_and_scaling_equal_transformers(rope_scaling):
    """YaRN's per-pair frequencies and the factor it scales cos and sin by, bit for bit those of transformers'
    _compute_yarn_parameters, for gpt-oss's settings and transformers' other branches."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from litsft.model.network.transformer import rope_attention_scaling, rope_inverse_frequencies

    scaling = {"rope_type": "yarn", **rope_scaling}
    hf_config = GptOssConfig(
        head_dim=64, max_position_embeddings=131072, rope_parameters={**scaling, "rope_theta": 150000.0}
    )
    expected, expected_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = Config.from_name("gpt-oss-20b", rope_scaling=scaling)
    assert torch.equal(rope_inverse_frequencies(config), expected)
    assert rope_attention_scaling(config) == expected_scaling
    plain = rope_inverse_frequencies(Config.from_name("gpt-oss-20b", rope_scaling=None))
    assert not torch.equal(plain, expected)


def test_yarn_without_its_original_context_is_refused():
    with pytest.raises(LitsftError, match="YaRN needs original_max_position_embeddings"):
        Config.from_name("tiny-gpt-oss", rope_scaling={"rope_type": "yarn", "factor": 4.0})
