"""litsft/model/accounting/flops.py: FLOPs per token by hand for a tiny config and against torch's FlopCounterMode for every
family (full and LoRA), the executed FLOPs of packed documents, windows, and peak FLOP/s per GPU and
precision (MFU from them: tests/test_training_metrics.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from litsft.errors import LitsftError
from litsft.model.accounting.flops import (
    TrainingFlops,
    causal_pairs,
    device_peak_flops,
    executed_training_flops,
    flops_per_token,
    gpu_peak_flops,
    matmul_precision,
)
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer

torch.set_num_threads(1)

TINY = Config(
    name="flops", vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1
)


def test_flops_per_token_hand_count():
    # Per layer: q 4*4 + k 4*2 + v 4*2 + o 4*4 = 48, MLP 3*4*6 = 72 -> 120; 2 layers + lm_head 10*4 -> N = 280.
    # Attention: 12 * layers 2 * (heads 2 * head_dim 2) * seq_len 8 = 768.
    assert flops_per_token(TINY, seq_len=8) == 6 * 280 + 768
    # LoRA: the first block's q, k, v (4*4 + 4*2 + 4*2 = 32) get no input gradient.
    assert flops_per_token(TINY, seq_len=8, trainable="lora") == 4 * 280 - 2 * 32 + 768


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
@pytest.mark.parametrize("trainable", ["all", "lora"])
def test_flops_per_token_matches_torch_flop_counter(trainable, tie_word_embeddings):
    config = Config.from_name("tiny-llama", tie_word_embeddings=tie_word_embeddings)
    model = Transformer(config)
    if trainable == "lora":  # frozen base: only input gradients flow back through the blocks
        model.requires_grad_(False)
        # ... from the first block's q, k, v on (adapters there make them need gradients; their inputs,
        # the embeddings, need none).
        for projection in (
            model.blocks[0].attn.q_proj,
            model.blocks[0].attn.k_proj,
            model.blocks[0].attn.v_proj,
        ):
            projection.register_forward_hook(lambda module, args, output: output.requires_grad_())
    batch, seq_len = 2, 16
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    # The math backend runs attention as bmm, which the counter sees (CPU's fused kernel it does not).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids).sum().backward()
    assert counter.get_total_flops() / (batch * seq_len) == flops_per_token(config, seq_len, trainable)


@pytest.mark.parametrize("targets", ["all-linear", ["q", "k", "v", "o"], ["q", "k", "v", "down", "lm_head"]])
def test_lora_flops_per_token_count_what_runs(targets):
    """A LoRA model as it trains: frozen base (4 per weight), the first block's q/k/v input gradients
    skipped, 6 per adapter weight. The adapters on the first block's q, k, v skip their A's input gradient
    too (2 * rank * hidden_size each, left out of the count: 0.01% of a 1B model's)."""
    from litsft.model.lora.layers import LoRAConfig, apply_lora

    config = Config.from_name("tiny-llama")
    lora = LoRAConfig(rank=4, dropout=0.0, targets=targets)
    model = apply_lora(Transformer(config), lora)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch, seq_len = 2, 16
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids).sum().backward()
    skipped_adapter_input = 3 * 2 * lora.rank * config.hidden_size
    expected = flops_per_token(config, seq_len, "lora", adapters) - skipped_adapter_input
    assert counter.get_total_flops() / (batch * seq_len) == expected
    assert flops_per_token(config, seq_len, "lora", adapters) > flops_per_token(config, seq_len, "lora")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("trainable", ["all", "lora"])
def test_executed_flops_count_each_documents_causal_pairs(window, trainable):
    """Executed FLOPs of packed documents: the weights' FLOPs per token (flops_per_token without attention),
    the output head on the loss tokens only, and attention on exactly the (query, key) pairs the document
    mask allows, layer by layer, windows included."""
    from litsft.model.network.attention import (
        Documents,
        cumulative_lengths,
        document_mask,
        token_document_ids,
    )

    config = Config.from_name("tiny-llama", sliding_window=window)
    lengths, head_tokens = [7, 1, 12, 3], 9
    tokens = sum(lengths)
    document_ids = token_document_ids(Documents(cumulative_lengths(lengths), max(lengths)), tokens)
    pairs = sum(
        int(document_mask(document_ids, config.attention_window(layer)).sum())
        for layer in range(config.num_layers)
    )
    head = config.hidden_size * config.vocab_size * (6 if trainable == "all" else 4)
    H, D = config.num_heads, config.head_dim
    expected = (
        flops_per_token(config, 0, trainable) * tokens - head * (tokens - head_tokens) + 12 * H * D * pairs
    )
    assert executed_training_flops(config, lengths, head_tokens, trainable) == expected
    # One plain causal row over the same tokens (what a loop that ignores the documents runs) does more.
    assert executed_training_flops(config, [tokens], head_tokens, trainable) > expected


def test_executed_flops_of_one_causal_row_are_the_full_row_count_less_the_masked_half():
    """flops_per_token credits every (query, key) pair of a row of T tokens, T^2 per layer; a causal kernel
    computes T(T + 1)/2 of them."""
    T, L, H, D = 64, TINY.num_layers, TINY.num_heads, TINY.head_dim
    masked = T * T - T * (T + 1) // 2
    assert executed_training_flops(TINY, [T], T) == flops_per_token(TINY, T) * T - 12 * L * H * D * masked


@pytest.mark.parametrize(
    ("device_name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16-true", 756e12),
        ("NVIDIA H200", "16-mixed", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312e12),
        ("NVIDIA A100 80GB PCIe", "32-true", 19.5e12),
        ("NVIDIA A10G", "bf16-mixed", 125e12),
        ("NVIDIA L4", "bf16-mixed", 121e12),
        ("NVIDIA L40S", "bf16-mixed", 362.05e12),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.2e12),
        ("Tesla V100-SXM2-16GB", "16-mixed", 125e12),
        ("Tesla V100-SXM2-16GB", "bf16-mixed", None),  # no bf16 units: emulated, no MFU
        ("Tesla V100-PCIE-32GB", "16-mixed", 112e12),
        ("NVIDIA H100 80GB HBM3", "64-true", None),
        ("Some Future GPU", "bf16-mixed", None),
    ],
)
def test_gpu_peak_flops(device_name, precision, expected):
    assert gpu_peak_flops(device_name, precision) == expected


def test_fp32_matmuls_count_as_tf32_when_torch_allows_it():
    previous = torch.get_float32_matmul_precision()
    try:
        assert matmul_precision("32-true") == "fp32"
        assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 19.5e12
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("32-true") == "tf32"
        assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") == 156e12
        assert gpu_peak_flops("Tesla T4", "32-true") == 8.1e12  # no TF32 units: fp32 rate
    finally:
        torch.set_float32_matmul_precision(previous)


def test_device_peak_flops_cpu_is_unknown_and_override_wins():
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "bf16-mixed") is None
    assert device_peak_flops(cpu, "bf16-mixed", peak_flops=100e12) == 100e12
    with pytest.raises(LitsftError, match=r"^peak_flops=0.0 must be a positive FLOP/s figure, e.g. 989e12$"):
        device_peak_flops(cpu, "bf16-mixed", peak_flops=0.0)


@pytest.mark.parametrize(
    ("length", "window", "expected"), [(4, None, 10), (4, 4, 10), (4, 9, 10), (6, 2, 3 + 4 * 2)]
)
def test_causal_pairs_by_hand(length, window, expected):
    """4 tokens: 1 + 2 + 3 + 4 pairs; a window of 2 over 6 tokens: 1 + 2, then 2 for each of the 4 others.
    A tensor of lengths is counted element by element (how the training loop counts a step's documents)."""
    assert causal_pairs(length, window) == expected
    assert causal_pairs(torch.tensor([length, 1]), window).tolist() == [expected, 1]


def _tiny_of_family(architecture: str) -> Config:
    """A tiny model of each registered family, its features (biases, q/k norms, tying, GQA, head_dim,
    windows) kept from its first named config."""
    from tiny_configs import tiny_shape

    from litsft.model.config import NAMED_CONFIGS
    from litsft.model.families import FAMILIES

    return tiny_shape(NAMED_CONFIGS[next(iter(FAMILIES[architecture].named_configs))])


def _every_family():
    from litsft.model.families import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("architecture", _every_family())
@pytest.mark.parametrize("trainable", ["all", "lora"])
def test_counts_of_every_family_equal_what_torch_counts(architecture, trainable):
    """FLOPs per token against FlopCounterMode, parameters against sum(p.numel()), LoRA adapters against the
    adapted model's trained parameters, for a tiny model of every registered family."""
    from litsft.model.accounting.flops import lora_parameters
    from litsft.model.accounting.sizes import num_parameters
    from litsft.model.lora.layers import LoRAConfig, apply_lora

    config = _tiny_of_family(architecture)
    model = Transformer(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    adapters = 0
    if trainable == "lora":
        lora = LoRAConfig(rank=2, dropout=0.0, targets="all-linear")
        model = apply_lora(model, lora)
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_parameters(config, lora.target_list, lora.rank) == adapters
    batch, seq_len = 2, 16
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids).sum().backward()
    skipped_adapter_input = 3 * 2 * 2 * config.hidden_size if trainable == "lora" else 0  # see above
    expected = flops_per_token(config, seq_len, trainable, adapters) - skipped_adapter_input
    assert counter.get_total_flops() / (batch * seq_len) == expected


def test_attention_flops_stop_at_each_layers_window():
    """A query attends to at most `window` keys: a windowed layer's attention counts the window, not the
    sequence; a full layer the sequence."""
    full = Config.from_name("tiny-llama")
    one_windowed = Config.from_name(
        "tiny-llama", sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    )
    both = Config.from_name("tiny-llama", sliding_window=4)
    width = full.num_heads * full.head_dim
    assert flops_per_token(full, 16) - flops_per_token(full, 0) == 2 * 3 * 4 * width * 16  # two layers
    assert flops_per_token(one_windowed, 16) - flops_per_token(full, 16) == -3 * 4 * width * (16 - 4)
    assert flops_per_token(both, 16) - flops_per_token(full, 16) == -2 * 3 * 4 * width * (16 - 4)
    assert flops_per_token(both, 3) == flops_per_token(full, 3)  # shorter than the window


@pytest.mark.parametrize("length", [32768, 131072])
def test_long_documents_count_attention_per_document_and_it_overtakes_the_matmuls(length):
    """At long-context lengths attention is counted per document, over its causal pairs (float64, past 2**53 at
    128k on Llama-3.1-8B): a row of four packed documents does a quarter of one document's attention. For
    Llama-3.1-8B the causal pairs cost as much as the matmuls at 57,256 tokens (12 H D L (T + 1) / 2
    = 6 N per token), so attention is the smaller part at 32k and the larger at 128k. Under context
    parallelism (Ulysses) every rank of a group attends whole documents with H/N heads, so the group executes
    exactly these FLOPs once: a rank's share is 1/N of them."""
    config = Config.from_name("Llama-3.1-8B")
    H, D, L = config.num_heads, config.head_dim, config.num_layers
    weights = executed_training_flops(config, [length], length) - 12 * L * H * D * length * (length + 1) / 2
    assert weights == pytest.approx(flops_per_token(config, 0) * length, rel=1e-12)
    one = executed_training_flops(config, [length], length) - weights
    packed = executed_training_flops(config, [length // 4] * 4, length) - weights
    assert one == pytest.approx(12 * L * H * D * length * (length + 1) // 2, rel=1e-12)
    assert packed == pytest.approx(4 * 12 * L * H * D * (length // 4) * (length // 4 + 1) // 2, rel=1e-12)
    assert packed / one == pytest.approx(0.25, rel=1e-4)
    assert (one > weights) == (length > 57_255)


def test_a_forward_pass_alone_is_what_torchs_flop_counter_counts():
    """`TrainingFlops.of(config, "none")`: a no-grad forward pass (a preference objective's live reference),
    the matmuls and the causal attention pairs as torch's counter sees them."""
    config = Config.from_name("tiny-llama")
    model = Transformer(config)
    batch, seq_len = 2, 16
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids)
    forward = TrainingFlops.of(config, "none")
    counted = forward.executed(torch.tensor([seq_len] * batch), batch * seq_len)
    # The math kernel computes every (query, key) pair of the square, the masked half too.
    masked = (
        batch * (seq_len * (seq_len - 1) // 2) * 4 * config.num_heads * config.head_dim * config.num_layers
    )
    assert counter.get_total_flops() == int(counted) + masked
