"""litsft/model/precision/float8.py: which layers become float8, the conversion on the meta device and on real weights
(names kept, numbers within float8 rounding of the original), and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.model.precision.float8 import (
    check_float8_device,
    check_float8_recipe,
    convert_to_float8,
    converts_to_float8,
    float8_layer_names,
)

LLAMA_3_2_1B_BLOCK = {  # (out, in): q 2048x2048, k and v 512x2048 (8 kv heads), o, gate, up, down
    "attn.q_proj": (True, False),  # (tensorwise, rowwise)
    "attn.k_proj": (False, False),
    "attn.v_proj": (False, False),
    "attn.o_proj": (True, False),
    "mlp.gate_proj": (True, True),
    "mlp.up_proj": (True, True),
    "mlp.down_proj": (True, False),
}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_conversion_on_the_meta_device_swaps_exactly_the_large_block_projections(recipe):
    """Llama-3.2-1B built on the meta device (as the engine builds it): tensorwise converts q, o, gate, up and
    down of every block, rowwise only gate and up; k and v (512 x 2048) and the tied output head stay."""
    from torchao.float8.float8_linear import Float8Linear

    config = Config.from_name("Llama-3.2-1B")
    with torch.device("meta"):
        model = Transformer(config)
    names_before = [name for name, _ in model.named_parameters()]
    column = 0 if recipe == "tensorwise" else 1
    expected = sorted(
        f"blocks.{i}.{layer}"
        for i in range(config.num_layers)
        for layer, chosen in LLAMA_3_2_1B_BLOCK.items()
        if chosen[column]
    )
    assert convert_to_float8(model, recipe, fsdp_all_gather=False) == expected
    converted = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert converted == expected
    assert type(model.lm_head) is nn.Linear
    assert [name for name, _ in model.named_parameters()] == names_before  # checkpoints and exports unchanged
    assert all(p.is_meta for p in model.parameters())


def test_layers_too_small_or_not_multiples_of_16_stay_in_bf16():
    def linear(out_features: int, in_features: int) -> nn.Linear:
        return nn.Linear(in_features, out_features, bias=False, device="meta")

    assert converts_to_float8("blocks.0.mlp.up_proj", linear(8192, 2048), "tensorwise")
    assert not converts_to_float8("lm_head", linear(128256, 2048), "tensorwise")  # outside the blocks
    assert not converts_to_float8("blocks.0.mlp.up_proj", linear(8200, 2048), "tensorwise")  # 8200 % 16
    assert not converts_to_float8("blocks.0.mlp.up_proj", linear(8192, 2056), "rowwise")
    assert not converts_to_float8("blocks.0.attn.k_proj", linear(1024, 4096), "tensorwise")  # too small
    assert converts_to_float8("blocks.0.attn.k_proj", linear(1024, 4112), "tensorwise")
    assert converts_to_float8("blocks.0.attn.k_proj", linear(1040, 4096), "tensorwise")
    assert not converts_to_float8("blocks.0.mlp.up_proj", linear(4096, 2048), "rowwise")
    assert converts_to_float8("blocks.0.mlp.up_proj", linear(4112, 2048), "rowwise")
    assert not converts_to_float8("blocks.0.attn.q_proj", linear(2048, 8192), "rowwise")  # N <= 2048


FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not FLOAT8_GPU, reason="needs float8 tensor cores (sm89+)"),
            ],
        ),
    ],
)
def test_a_converted_model_keeps_its_weights_and_computes_within_float8_rounding(device):
    """Real weights (on the CPU, where torch runs float8 matmuls too, and on a GPU's float8 tensor cores): the
    same state dict, and the loss and gradients of the float8 model within float8 rounding of the original's
    (e4m3 forward: 3 mantissa bits; e5m2 gradients: 2)."""
    torch.manual_seed(0)
    config = Config.from_name(
        "tiny-llama", num_layers=2, hidden_size=256, intermediate_size=1040, num_heads=4, num_kv_heads=2
    )
    reference = Transformer(config)
    reference.init_weights(0)
    model = Transformer(config)
    model.load_state_dict(reference.state_dict())
    reference, model = reference.to(device), model.to(device)
    assert convert_to_float8(model, "tensorwise", fsdp_all_gather=False) == [
        "blocks.0.mlp.gate_proj", "blocks.0.mlp.up_proj", "blocks.1.mlp.gate_proj", "blocks.1.mlp.up_proj",
    ]  # fmt: skip
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.equal(state[name], value) for name, value in reference.state_dict().items())
    input_ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(device)
    losses = []
    for network in (reference, model):
        with torch.autocast(
            device, torch.bfloat16, enabled=device == "cuda"
        ):  # as bf16-mixed trains on a GPU
            logits = network(input_ids).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=0)
    for name, param in reference.named_parameters():
        other = model.get_parameter(name).grad
        relative = (other - param.grad).norm() / param.grad.norm()
        assert relative < 0.15, (name, relative.item())  # measured up to 0.089 (e5m2 gradients)
    # float8 changed the numbers (the conversion took effect) without changing them beyond its rounding.
    assert not torch.equal(
        model.blocks[0].mlp.up_proj.weight.grad, reference.blocks[0].mlp.up_proj.weight.grad
    )


def test_float8_layer_names_are_what_the_conversion_swaps():
    with torch.device("meta"):
        model = Transformer(Config.from_name("Llama-3.2-1B", num_layers=1))
    assert float8_layer_names(model, "rowwise") == ["blocks.0.mlp.gate_proj", "blocks.0.mlp.up_proj"]


@pytest.mark.parametrize(
    ("device_type", "capability", "name", "precision", "message"),
    [
        ("cpu", None, "", "bf16-mixed", "needs a CUDA GPU with float8 tensor cores (compute capability 8.9 or "
         "newer: L4, RTX 4090, H100, B200); this run is on the CPU; drop --train.float8"),
        ("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", "bf16-mixed", "this GPU (NVIDIA A100-SXM4-80GB, 8.0) has none"),
        ("cuda", (8, 6), "NVIDIA RTX A6000", "bf16-mixed", "this GPU (NVIDIA RTX A6000, 8.6) has none"),
        ("cuda", (9, 0), "NVIDIA H100", "32-true", "use --precision bf16-mixed (or bf16-true), not 32-true"),
    ],
)  # fmt: skip
def test_a_device_without_float8_tensor_cores_is_refused_in_one_line(
    device_type, capability, name, precision, message
):
    with pytest.raises(LitsftError, match="^--train.float8 tensorwise ") as refused:
        check_float8_device("tensorwise", precision, device_type, capability, name)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("capability", "precision"), [((8, 9), "bf16-mixed"), ((9, 0), "bf16-true"), ((10, 0), "bf16-mixed")]
)
def test_gpus_with_float8_tensor_cores_pass(capability, precision):
    check_float8_device("rowwise", precision, "cuda", capability, "GPU")
    check_float8_device(None, "32-true", "cpu")  # off: nothing to check


def test_finetune_lora_refuses_float8():
    check_float8_recipe("tensorwise", "finetune_full")
    check_float8_recipe("rowwise", "pretrain")
    check_float8_recipe(None, "finetune_lora")
    with pytest.raises(LitsftError, match="^--train.float8 tensorwise is for finetune_full and pretrain"):
        check_float8_recipe("tensorwise", "finetune_lora")
