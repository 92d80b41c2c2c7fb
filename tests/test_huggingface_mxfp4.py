"""MXFP4 experts as the hub stores gpt-oss: dequantized as transformers does, converted, exported as bf16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf import save_tiny_hf, tiny_hf_model
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf, convert_to_hf
from litsft.huggingface.mxfp4 import dequantize
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer

QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}  # gpt-oss-20b's config.json
EXPERTS = ("gate_up_proj", "down_proj")


def _random_mxfp4(
    generator: torch.Generator, experts: int, rows: int, columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (E, rows, columns / 32, 16) of every 4-bit code, scales around 2^0 (exponents 120 to 130)."""
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(120, 131, (experts, rows, columns // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_dequantize_equals_transformers_bit_for_bit():
    """Random blocks of every code and scales from 2^-127 to 2^128: transformers' convert_moe_packed_tensors."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 256, (3, 10, 4), dtype=torch.uint8, generator=generator)
    got, expected = dequantize(blocks, scales), convert_moe_packed_tensors(blocks, scales)
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == (3, 128, 10)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # the same bits, infinities and all
    assert not torch.equal(dequantize(blocks, scales + 1), expected)


def _mxfp4_checkpoint(tmp_path):
    """The tiny gpt-oss with MXFP4 experts: a hub-like folder (blocks, scales, quantization_config) and the
    transformers model holding what transformers dequantizes them to."""
    hf_model = tiny_hf_model("gpt-oss")
    config = hf_model.config
    generator = torch.Generator().manual_seed(1)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            for name, (rows, columns) in zip(
                EXPERTS,
                (
                    (2 * config.intermediate_size, config.hidden_size),
                    (config.hidden_size, config.intermediate_size),
                ),
            ):
                blocks, scales = _random_mxfp4(generator, config.num_local_experts, rows, columns)
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales).float())
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                packed |= {f"{prefix}_blocks": blocks, f"{prefix}_scales": scales}
    hf_dir = save_tiny_hf(hf_model, tmp_path / "hf")
    dense = load_file(hf_dir / "model.safetensors")
    dense = {name: tensor for name, tensor in dense.items() if not name.endswith(EXPERTS)}
    save_file(dense | packed, hf_dir / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**hf_config, "quantization_config": QUANTIZATION_CONFIG}))
    return hf_model, hf_dir


def test_an_mxfp4_checkpoint_converts_to_transformers_logits_and_exports_as_bf16(tmp_path):
    """The hub's layout converts to the logits transformers computes from its own dequantization (fp32, within
    1e-4); the export writes each expert tensor transformers would hold, in bf16 and bit for bit, with a
    config.json that says nothing of a quantization, which transformers loads without a missing tensor."""
    from transformers import AutoModelForCausalLM

    hf_model, hf_dir = _mxfp4_checkpoint(tmp_path)
    convert_from_hf(hf_dir, tmp_path / "litsft")
    config = Config.from_checkpoint(tmp_path / "litsft")
    model = Transformer(config).eval()
    state = load_model_state_dict(tmp_path / "litsft")
    assert state["blocks.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    model.load_state_dict(state)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert (model(tokens) - expected).abs().max() < 1e-4

    convert_to_hf(tmp_path / "litsft", tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    for i, layer in enumerate(hf_model.model.layers):
        for name in EXPERTS:
            tensor = exported[f"model.layers.{i}.mlp.experts.{name}"]
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor.float(), getattr(layer.mlp.experts, name))
    assert not any(name.endswith(("_blocks", "_scales")) for name in exported)
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())


def _expect_refused(tmp_path, hf_dir, message):
    with pytest.raises(LitsftError, match=message):
        convert_from_hf(hf_dir, tmp_path / "litsft")
    assert not (tmp_path / "litsft").exists()


def test_an_mxfp4_tensor_without_its_scales_is_refused_in_one_line(tmp_path):
    _, hf_dir = _mxfp4_checkpoint(tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, hf_dir / "model.safetensors")
    _expect_refused(
        tmp_path,
        hf_dir,
        r"^.*model.safetensors: 'model.layers.1.mlp.experts.down_proj_blocks' is half of an MXFP4 tensor whose "
        r"'model.layers.1.mlp.experts.down_proj_scales' is missing; the checkpoint is incomplete, download it again$",
    )


def test_mxfp4_blocks_of_another_shape_or_dtype_are_refused_in_one_line(tmp_path):
    _, hf_dir = _mxfp4_checkpoint(tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, hf_dir / "model.safetensors")
    _expect_refused(
        tmp_path,
        hf_dir,
        r"MXFP4 tensor 'model.layers.0.mlp.experts.gate_up_proj' has blocks \[4, 256, 2, 16\] \(torch.uint8\) and "
        r"scales \[4, 256, 2\] \(torch.int32\), but litsft dequantizes uint8 blocks",
    )


def test_a_quantization_other_than_mxfp4_is_refused_in_one_line(tmp_path):
    _, hf_dir = _mxfp4_checkpoint(tmp_path)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8"}
    (hf_dir / "config.json").write_text(json.dumps(hf_config))
    _expect_refused(
        tmp_path,
        hf_dir,
        r"^quantization_config's quant_method is 'fp8', but litsft converts gpt-oss in bf16 or from the hub's mxfp4 "
        r"only; use the original checkpoint$",
    )
