"""litsft/model/network/mlp.py: the dense MLP against transformers' Llama (SwiGLU) and Gemma (GeGLU) MLPs with
the same weights, and the gated activation the MoE experts share."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.configuration_gemma import GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from litsft.model.config import Config
from litsft.model.network.mlp import MLP, gated_activation


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_mlp_equals_transformers(activation: str) -> None:
    config = Config.from_name("tiny-llama", mlp_activation=activation)
    mlp = MLP(config)
    sizes = dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size)
    if activation == "silu":
        reference = LlamaMLP(LlamaConfig(**sizes, hidden_act="silu"))
    else:
        reference = GemmaMLP(GemmaConfig(**sizes, hidden_activation="gelu_pytorch_tanh"))
    reference.load_state_dict(mlp.state_dict())
    x = torch.randn(2, 5, config.hidden_size)
    torch.testing.assert_close(mlp(x), reference(x), rtol=0, atol=0)


def test_the_gated_activation_is_swiglu_or_geglu() -> None:
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    assert torch.equal(gated_activation(gate, up), torch.nn.functional.silu(gate) * up)
    geglu = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.equal(gated_activation(gate, up, "gelu_tanh"), geglu)
    assert not torch.equal(gated_activation(gate, up, "gelu_tanh"), gated_activation(gate, up))
