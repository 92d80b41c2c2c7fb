"""litsft/model/accounting/sizes.py's activation count (what a block saves for its backward pass, recorded on fake tensors)
against a measurement: the tensors autograd's graph holds after a real forward pass of the same block. The
parameter and FLOP counts are held against transformers and FlopCounterMode in tests/test_model_config.py and
tests/test_model_accounting_flops.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_configs import tiny_shape

from litsft.model.accounting.sizes import ACTIVATION_PROBE_TOKENS, block_saved_bytes_per_token
from litsft.model.config import NAMED_CONFIGS, Config
from litsft.model.families import FAMILIES
from litsft.model.lora.layers import LoRAConfig, apply_lora
from litsft.model.network.attention import prepare
from litsft.model.network.transformer import Transformer, rope_cos_sin


def tiny_of(config: Config) -> Config:
    """The family's block features at tiny widths, without windows or a soft-cap: the fused kernel the plan
    assumes keeps the same tensors with either."""
    return dataclasses.replace(
        tiny_shape(config), sliding_window=None, layer_types=None, softcap_attention=None
    )


def graph_saved_bytes(outputs: list[torch.Tensor], not_owned: set[int]) -> int:
    """Bytes of the tensors the autograd graph behind `outputs` holds (each node's saved tensors, a custom
    Function's included), each storage once, without the storages in `not_owned` and scalars."""
    sizes: dict[int, int] = {}
    stack, visited = [output.grad_fn for output in outputs], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                value = getattr(node, name)
                for tensor in value if isinstance(value, tuple | list) else (value,):
                    if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                        storage = tensor.untyped_storage()
                        if storage.data_ptr() not in not_owned:
                            sizes[storage.data_ptr()] = storage.nbytes()
        stack.extend(function for function, _ in node.next_functions)
    return sum(sizes.values())


@pytest.mark.parametrize("lora", [None, LoRAConfig(targets=["q", "v", "down"])], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", FAMILIES)
def test_saved_activations_equal_what_a_real_forward_pass_keeps(architecture, dtype, lora):
    config = tiny_of(NAMED_CONFIGS[list(FAMILIES[architecture].named_configs)[-1]])
    if lora is not None and config.num_experts:  # a mixture of experts' MLP is not adapted
        lora = LoRAConfig(targets=["q", "v", "o"])
    tokens = ACTIVATION_PROBE_TOKENS
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Transformer(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    if lora is not None:
        apply_lora(model, lora)
    # The block the count is of: the largest (a Qwen2-MoE layer routes its MLP where the first may not).
    block = max(model.blocks, key=lambda block: sum(p.numel() for p in block.parameters()))
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(config, torch.arange(tokens)[None], dtype)
    output = block(x, cos, sin, prepare("segmented", (1, tokens), x.device))
    not_owned = {tensor.untyped_storage().data_ptr() for tensor in (*block.parameters(), cos, sin)}
    # A mixture of experts' router probabilities feed the load-balancing loss too: with gpt-oss's softmax over the
    # top k logits, they reach no output.
    routing = getattr(block.mlp, "routing", None)
    measured = graph_saved_bytes([output, *([routing.probability_sums] if routing else [])], not_owned)
    assert block_saved_bytes_per_token(config, dtype, lora) * tokens == measured
    # The count follows the block: a frozen block keeps less than a trained one.
    if lora is None:
        assert block_saved_bytes_per_token(config, dtype, LoRAConfig(targets=["lm_head"])) * tokens < measured
