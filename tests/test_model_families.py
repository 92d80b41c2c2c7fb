"""litsft/model/families/: the weight-name maps of spec.py (both ways, fused tensors), and one section per family
module, its tests named by the module (`[gemma2]`, `[qwen3]`...): it registers its family, config.jsons
resolve to it, its weight map names every parameter of its configs. Logits against transformers: below for
Gemma 2, Gemma 3 and OLMo 2; every family's in tests/test_checkpoint_convert.py (conversion round trip) and
tests/test_model_network.py (sliding windows)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_hf import SLIDING_WINDOW, assert_logits_match_transformers, save_tiny_hf, tiny_hf_model

from litsft.checkpoint.convert import convert_from_hf, expected_shapes
from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.inference.generate import generate_tokens
from litsft.model.config import NAMED_CONFIGS, Config
from litsft.model.families import FAMILIES, family_of_hf_config
from litsft.model.families.phi3 import PHI3_WEIGHTS
from litsft.model.families.spec import LLAMA_WEIGHTS
from litsft.model.network import Transformer

torch.set_num_threads(1)


def test_llama_names_both_ways():
    assert LLAMA_WEIGHTS.hf_name("blocks.11.attn.q_norm.weight") == "model.layers.11.self_attn.q_norm.weight"
    assert LLAMA_WEIGHTS.litsft_names("model.layers.3.post_attention_layernorm.weight") == (
        "blocks.3.mlp_norm.weight",
    )
    assert LLAMA_WEIGHTS.litsft_names("model.embed_tokens.weight") == ("embed.weight",)
    assert LLAMA_WEIGHTS.litsft_names("model.layers.0.mlp.experts.weight") is None
    assert LLAMA_WEIGHTS.is_ignored("model.layers.7.self_attn.rotary_emb.inv_freq")


def test_fused_tensors_split_and_fuse_back_bit_exactly():
    """A GQA model (q wider than k and v) through a fused map: HF -> litsft splits qkv_proj and gate_up_proj by
    the model's own shapes, litsft -> HF joins them again, bit for bit."""
    config = Config.from_name("tiny-llama", num_layers=2)
    shapes = expected_shapes(config)
    generator = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    hf = dict(PHI3_WEIGHTS.to_hf(reversed(list(model.items())), torch.cat))  # parts arrive in any order
    assert hf["model.layers.1.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    assert hf["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 176, 64)
    assert torch.equal(
        hf["model.layers.1.self_attn.qkv_proj.weight"][64:96], model["blocks.1.attn.k_proj.weight"]
    )
    back = dict(PHI3_WEIGHTS.from_hf(hf.items(), shapes))
    assert back.keys() == model.keys()
    assert all(torch.equal(back[name], model[name]) for name in model)
    again = dict(PHI3_WEIGHTS.to_hf(back.items(), torch.cat))
    assert all(torch.equal(again[name], hf[name]) for name in hf)
    assert PHI3_WEIGHTS.hf_name("blocks.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"


def test_a_fused_tensor_with_a_missing_part_is_an_error():
    config = Config.from_name("tiny-llama", num_layers=1)
    parts = [
        (n, torch.zeros(s)) for n, s in expected_shapes(config).items() if n != "blocks.0.attn.v_proj.weight"
    ]
    with pytest.raises(KeyError, match="never came"):
        list(PHI3_WEIGHTS.to_hf(parts, torch.cat))


def family_module(architecture: str) -> str:
    """The module of litsft/model/families/ that defines a registered family, e.g. "gemma2": the test ids name it."""
    return FAMILIES[architecture].config_from_hf.__module__.rpartition(".")[2]


FAMILY_MODULES = sorted(
    path.stem for path in (Path(__file__).parents[1] / "litsft" / "model" / "families").glob("*.py")
    if path.stem not in ("__init__", "spec")
)  # fmt: skip


@pytest.mark.parametrize("module", FAMILY_MODULES)
def test_each_family_module_registers_one_family_that_its_config_jsons_resolve_to(module):
    """litsft/model/families/<module>.py registers one family; a config.json naming its architecture, or only its
    model_type, resolves to it; its named configs build as that architecture."""
    (architecture,) = [name for name in FAMILIES if family_module(name) == module]
    family = FAMILIES[architecture]
    assert family_of_hf_config({"architectures": [architecture]}) is family
    assert family_of_hf_config({"model_type": family.model_type}) is family
    assert family.named_configs
    assert all(Config.from_name(name).hf_architecture == architecture for name in family.named_configs)


@pytest.mark.parametrize("architecture", FAMILIES, ids=family_module)
def test_every_family_names_every_parameter_of_its_configs(architecture):
    """Each family's weight map covers every parameter its named configs build: one-to-one, or several parts
    to one fused tensor whose parts are all parameters of the model."""
    family = FAMILIES[architecture]
    for name in family.named_configs:
        config = NAMED_CONFIGS[name]
        first_type = config.layer_types[:1] if config.layer_types else None
        config = dataclasses.replace(config, num_layers=1, layer_types=first_type)
        names = list(expected_shapes(config))
        hf = {n: family.weights.hf_name(n) for n in names}
        assert all(n in family.weights.litsft_names(h) for n, h in hf.items())
        assert sorted(part for h in set(hf.values()) for part in family.weights.litsft_names(h)) == sorted(
            names
        )


# ---- each family against transformers -----------------------------------------------------------------
LENGTH = 64  # four times the tiny models' window


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "olmo2"])
@pytest.mark.parametrize("kernel", ["segmented", "mask"])
def test_logits_and_greedy_generation_equal_transformers(tmp_path, kind, kernel):
    """A tiny random model of the family, converted from transformers: the same logits (fp32) at 64 tokens, two
    documents packed in a row give each document's own, and greedy decoding with the KV cache writes what
    transformers' generate writes, past the sliding window."""
    hf_model = tiny_hf_model(kind)
    convert_from_hf(save_tiny_hf(hf_model, tmp_path / "hf"), tmp_path / "litsft")
    model = Transformer(Config.from_checkpoint(tmp_path / "litsft")).eval()
    model.load_state_dict(load_model_state_dict(tmp_path / "litsft"))
    model.attention_kernel = kernel
    # The CPU's per-document SDPA cannot soft-cap: the mask kernel does.
    if model.config.softcap_attention is not None:
        assert model.attention_kernel == "mask"
    tokens = torch.randint(0, 512, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    assert_logits_match_transformers(model, hf_model, tokens)

    prompt = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(1))
    new = LENGTH - 5
    with torch.no_grad():
        expected_tokens = hf_model.generate(
            prompt[None], max_new_tokens=new, do_sample=False, min_new_tokens=new
        )
    assert generate_tokens(model, prompt, max_new_tokens=new).tolist() == expected_tokens[0, 5:].tolist()
    assert model.config.sliding_window in (None, SLIDING_WINDOW)
