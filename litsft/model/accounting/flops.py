"""FLOP accounting: the training FLOPs of one token, those a pass over given documents executes, LoRA's
trained adapter parameters, and the peak FLOP/s of a device.

Counts over the model as built (litsft.model.accounting.sizes reads it off `Transformer(config)` on the meta
device) and a device name. `litsft.training.metrics` uses `TrainingFlops` (from each step's documents) and
`device_peak_flops` for the MFU column; `flops_per_token`, `executed_training_flops` and `lora_parameters` serve
the benchmarks (litsft.training.plan counts LoRA's adapters on the model it builds, not with `lora_parameters`).
tests/test_model_accounting_flops.py holds the counts against torch's FlopCounterMode for every family.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from litsft.errors import LitsftError
from litsft.model.accounting.sizes import model_sizes
from litsft.model.config import Config

LengthT = TypeVar("LengthT", int, torch.Tensor)


def flops_per_token(
    config: Config, seq_len: int, trainable: Literal["all", "lora"] = "all", adapter_parameters: int = 0
) -> float:
    """Training FLOPs per token for one forward and backward pass (PaLM appendix B, as torchtitan counts).

    N counts the weights of every matmul: each block's linear layers (an MoE router too) and the k experts a
    token is routed to (not all E: the active parameters, as MoE reports count them), and lm_head, which runs even when
    tied to the embedding; the embedding lookup is a gather and costs none. Norms, biases, RoPE and
    softmax are elementwise and left out. Attention scores and their weighted sum add 4 * H * D * keys per
    token and layer in the forward pass, where keys is `seq_len`, or the layer's sliding window when that is
    shorter (a query never sees more keys), counted over the full square, causal mask or not, so numbers
    compare with other reports. Pass the length the attention kernel processes: a document's length for the
    document kernels, the padded or packed block length for the mask kernel.

    Args:
        config: The model's shape.
        seq_len: Tokens per sequence as the attention kernel sees them.
        trainable: "all": forward 2N, backward 4N (input and weight gradients) = 6N. "lora": the base
            weights are frozen, so the backward skips weight gradients: 2N + 2N = 4N, less the input
            gradients of the first block's q, k and v projections (nothing before them trains, so autograd
            skips them, and the input gradients of their adapters, not counted); each adapter weight is
            trained: 6 per parameter. Assumes adapters on the first block's q, k and v (all-linear, the
            default): without them autograd skips that block's attention backward too. Attention has no
            weights, so its backward costs twice its forward either way.
        adapter_parameters: LoRA's trained adapter parameters (A and B of every adapted projection).
    """
    sizes = model_sizes(config)
    attention_forward = sum(
        4 * layer.attention_width * min(seq_len, layer.window or seq_len) for layer in sizes.layers
    )
    if trainable == "all":
        dense = 6 * sizes.matmul_weights
    else:
        first = sizes.layers[0].linear
        first_block_qkv = sum(first[target][0] * first[target][1] for target in ("q", "k", "v"))
        dense = 4 * sizes.matmul_weights - 2 * first_block_qkv + 6 * adapter_parameters
    return float(dense + 3 * attention_forward)


def causal_pairs(length: LengthT, window: int | None = None) -> LengthT:
    """(query, key) pairs causal attention computes in a sequence of `length` tokens: each query with itself
    and the keys before it, at most `window` of them with a sliding window. `length` may be a tensor of
    lengths, counted element by element."""
    if window is None:
        seen = length
    else:
        seen = length.clamp(max=window) if isinstance(length, torch.Tensor) else min(length, window)
    return seen * (seen + 1) // 2 + (length - seen) * seen


@dataclass(frozen=True)
class TrainingFlops:
    """The training FLOPs (forward and backward) that one pass executes, as a function of what it runs over:
    the blocks' matmuls on every token, the output head on `head_tokens` tokens (litsft runs it on the tokens
    that carry a loss only; a plain loop on every position), and attention within each document over the
    causal pairs it computes, windows included, not over whole rows. A plain causal loop over a packed row
    is one document of the row's length. An MFU from these credits only the work done.

    Weights as `flops_per_token` counts them (6 per trained weight and token, LoRA's frozen base 4, the
    first block's q, k, v input gradients skipped; adapters counted on every token), attention 4 * H * D
    per pair and layer forward (H * D: the layer's query width), three times that with the backward pass.
    Built once from the model's sizes (`of`); `executed` is tensor arithmetic on the host, so the training
    loop counts every step without reading a tensor."""

    block_flops_per_token: int
    head_flops_per_token: int
    attention_flops_per_pair: tuple[tuple[int | None, int], ...]
    """(sliding window or None, FLOPs per causal pair summed over the layers with that window)."""

    @classmethod
    def of(
        cls, config: Config, trainable: Literal["all", "lora", "none"] = "all", adapter_parameters: int = 0
    ) -> TrainingFlops:
        """`trainable` "none": a forward pass alone (no gradient), 2 FLOPs per weight and token, attention a
        third of the training pass's (a preference objective's live reference)."""
        sizes = model_sizes(config)
        head = sizes.lm_head[0] * sizes.lm_head[1]
        blocks = sizes.matmul_weights - head
        passes = 1 if trainable == "none" else 3  # forward; forward and backward (twice the forward)
        if trainable == "none":
            block_flops, head_flops = 2 * blocks, 2 * head
        elif trainable == "all":
            block_flops, head_flops = 6 * blocks, 6 * head
        else:
            first = sizes.layers[0].linear
            first_block_qkv = sum(first[target][0] * first[target][1] for target in ("q", "k", "v"))
            block_flops, head_flops = 4 * blocks - 2 * first_block_qkv + 6 * adapter_parameters, 4 * head
        per_pair: dict[int | None, int] = {}
        for layer in sizes.layers:
            per_pair[layer.window] = per_pair.get(layer.window, 0) + passes * 4 * layer.attention_width
        return cls(block_flops, head_flops, tuple(per_pair.items()))

    def executed(self, document_lengths: torch.Tensor, head_tokens: torch.Tensor | int) -> torch.Tensor:
        """The FLOPs of one pass over documents of these lengths (a 1-D tensor) with the head on
        `head_tokens` tokens, as a float64 tensor on the lengths' device (exact up to 2**53)."""
        lengths = document_lengths.to(torch.float64)
        attention = sum(
            per_pair * causal_pairs(lengths, window).sum()
            for window, per_pair in self.attention_flops_per_pair
        )
        return (
            self.block_flops_per_token * lengths.sum() + self.head_flops_per_token * head_tokens + attention
        )


def executed_training_flops(
    config: Config,
    document_lengths: Sequence[int],
    head_tokens: int,
    trainable: Literal["all", "lora"] = "all",
    adapter_parameters: int = 0,
) -> float:
    """`TrainingFlops.executed` of `config` for documents of these lengths, as a number."""
    flops = TrainingFlops.of(config, trainable, adapter_parameters)
    return float(flops.executed(torch.tensor(list(document_lengths), dtype=torch.int64), head_tokens))


def lora_parameters(config: Config, targets: Iterable[str], rank: int) -> int:
    """Trained parameters of LoRA adapters on `targets` (q, k, v, o, gate, up, down in every block, lm_head
    once): A (rank x in) and B (out x rank) per adapted projection, as litsft.model.lora.layers.apply_lora makes them."""
    sizes = model_sizes(config)
    targets = list(targets)
    # An MoE block has no gate, up or down projection to adapt (litsft.model.lora.layers.apply_lora skips it).
    blocks = sum(rank * sum(layer.linear[t]) for layer in sizes.layers for t in targets if t in layer.linear)
    head = rank * sum(sizes.lm_head) if "lm_head" in targets else 0
    return blocks + head


# Dense (no 2:4 sparsity) peak tensor-core FLOP/s per GPU, from NVIDIA's datasheets. An entry matches
# when all its words occur in torch.cuda.get_device_name(); the first match wins, so specific names
# come first. bf16/fp16 are with fp32 accumulation (what training uses; GeForce cards halve it).
# A missing "tf32" means the GPU has no TF32 units: fp32 matmuls then run at the "fp32" rate. A missing
# "bf16" (V100, T4) means bf16 is emulated and no MFU is reported.
_GPU_PEAK_FLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("b200",), {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 75e12}),
    (("h200", "nvl"), {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("h200",), {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (("gh200",), {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (("h100", "nvl"), {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (("h100", "pcie"), {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (("h100", "hbm2e"), {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),  # PCIe
    (("h100",), {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    (("a100",), {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (("a10g",), {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),  # AWS's A10
    (("a10",), {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (("l40s",), {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    (("l40",), {"bf16": 181.05e12, "fp16": 181.05e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    (("l4",), {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (("rtx", "4090"), {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    (("rtx", "3090"), {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    (("v100s",), {"fp16": 130e12, "fp32": 16.4e12}),
    (("v100", "pcie"), {"fp16": 112e12, "fp32": 14e12}),
    (("v100",), {"fp16": 125e12, "fp32": 15.7e12}),
    (("t4",), {"fp16": 65e12, "fp32": 8.1e12}),
)


def matmul_precision(precision: str) -> Literal["bf16", "fp16", "tf32", "fp32"] | None:
    """The number format matmuls run in under a Fabric precision ("bf16-mixed", "16-true", "32-true",
    ...) or a plain name; None for formats without a peak in the table (fp64, fp8)."""
    name = str(precision).lower()
    if name.startswith("bf16"):
        return "bf16"
    if name.startswith(("16", "fp16", "float16")):
        return "fp16"
    if name == "tf32":
        return "tf32"
    if name.startswith(("32", "fp32", "float32")):
        # torch.set_float32_matmul_precision("high") lets fp32 matmuls run on TF32 tensor cores.
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one GPU named as `torch.cuda.get_device_name()` names it, or None if the
    GPU or the precision is not in the table."""
    fmt = matmul_precision(precision)
    words = set(re.split(r"[\s\-_]+", device_name.lower()))
    for required, peaks in _GPU_PEAK_FLOPS:
        if set(required) <= words:
            if fmt == "tf32" and "tf32" not in peaks:
                fmt = "fp32"
            return peaks.get(fmt) if fmt else None
    return None


def device_peak_flops(device: torch.device, precision: str, peak_flops: float | None = None) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (CPU, an unlisted GPU): MFU is then not
    reported rather than guessed.

    Args:
        device: The training device.
        precision: Fabric's precision setting, e.g. "bf16-mixed".
        peak_flops: An explicit peak that overrides the table, for GPUs it lacks or a known clock limit.
    """
    if peak_flops is not None:
        if not peak_flops > 0:
            raise LitsftError(f"peak_flops={peak_flops} must be a positive FLOP/s figure, e.g. 989e12")
        return float(peak_flops)
    if device.type != "cuda":
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
