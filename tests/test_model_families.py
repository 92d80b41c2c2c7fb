"""litsft/model/families/: the weight-name maps of spec.py (both ways, fused tensors); each family's declaration
of the config.json keys it reads and ignores, held against transformers' config class for its architecture,
and the refusal of a value it cannot compute; then one section per family module, its tests named by the module
(`[gemma2]`, `[qwen3]`...): it registers its family, config.jsons resolve to it, its weight map names every
parameter of its configs. Logits against transformers: below for Gemma 2, Gemma 3, OLMo 2 and Granite; every
family's in tests/test_huggingface_convert.py (conversion round trip) and tests/test_model_network_transformer.py (sliding
windows)."""

import copy
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_hf import (
    MOE_KINDS,
    SLIDING_WINDOW,
    TINY_HF_MODELS,
    assert_logits_match_transformers,
    save_tiny_hf,
    tiny_hf_model,
)
from transformers import AutoConfig, PretrainedConfig

from litsft.__main__ import main
from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.errors import LitsftError
from litsft.huggingface.convert import convert_from_hf, expected_shapes
from litsft.inference.generate import generate_tokens
from litsft.model.config import NAMED_CONFIGS, Config
from litsft.model.families import FAMILIES, family_of_hf_config
from litsft.model.families.phi3 import PHI3_WEIGHTS
from litsft.model.families.spec import LLAMA_WEIGHTS, SHARED_HF_KEYS, Family
from litsft.model.network.transformer import Transformer

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


# ---- the config.json keys each family declares, against transformers' config classes ----------------------
GENERIC_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
    }
)
"""Keys every transformers config has (PretrainedConfig's own), left out of each family's declaration: they
name the checkpoint and steer transformers' outputs (which tensors it returns, classification labels,
feed-forward chunking for memory), never what a decoder computes; litsft reads the few it needs (SHARED_HF_KEYS)."""


def test_the_generic_keys_are_pretrained_configs_own():
    """A key transformers adds to every config fails here, so that someone decides whether it changes the math."""
    assert set(PretrainedConfig().to_dict()) == GENERIC_CONFIG_KEYS


def transformers_config(family: Family) -> dict[str, Any]:
    """transformers' default config of the family's architecture, as its config.json would hold it."""
    return json.loads(json.dumps(AutoConfig.for_model(family.model_type).to_dict()))


def undeclared_keys(family: Family) -> list[str]:
    """The keys of transformers' config class for the family that it neither reads (nor are read for every
    family) nor declares ignored."""
    declared = SHARED_HF_KEYS | family.hf_keys_read | set(family.hf_keys_ignored)
    return sorted(set(transformers_config(family)) - GENERIC_CONFIG_KEYS - declared)


@pytest.mark.parametrize("architecture", FAMILIES, ids=lambda architecture: family_module(architecture))
def test_every_key_of_transformers_config_class_is_read_or_ignored_with_a_reason(architecture):
    """A family that forgets a knob of its architecture fails here instead of converting with other logits.
    Each ignored key says why; a key ignored only at some values lists transformers' default among them."""
    family = FAMILIES[architecture]
    assert undeclared_keys(family) == []
    assert not (family.hf_keys_read | SHARED_HF_KEYS) & set(family.hf_keys_ignored)
    defaults = transformers_config(family)
    for key, ignored in family.hf_keys_ignored.items():
        assert len(ignored.why) > 20, key
        if ignored.supported is not None and key in defaults:
            assert defaults[key] in ignored.supported, key


def test_the_check_reports_a_key_a_family_stops_reading(monkeypatch):
    """Granite without `logits_scaling` in its declaration (as if its config_from_hf forgot it): the check
    names the key and the test above fails."""
    granite = FAMILIES["GraniteForCausalLM"]
    forgetful = dataclasses.replace(granite, hf_keys_read=granite.hf_keys_read - {"logits_scaling"})
    monkeypatch.setitem(FAMILIES, "GraniteForCausalLM", forgetful)
    assert undeclared_keys(forgetful) == ["logits_scaling"]
    with pytest.raises(AssertionError, match="logits_scaling"):
        test_every_key_of_transformers_config_class_is_read_or_ignored_with_a_reason("GraniteForCausalLM")


class KeysRead(dict):
    """A config.json dict that records which keys are looked up."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.looked_up: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return super().__contains__(key)


def config_jsons_of(family: Family) -> list[dict[str, Any]]:
    """Config.jsons that take each path of a family's translation: transformers' default config of the
    family, the config.json of each tiny model of tests/tiny_hf.py (windows, partial rotary, LongRoPE...), the
    export of each of its named configs (the keys of published config.json files), each also with its false
    flags turned on (use_sliding_window...) and a sliding window."""
    tiny = [
        config.to_dict() for config, _ in TINY_HF_MODELS.values() if config.model_type == family.model_type
    ]
    named = [Config.from_name(name).to_hf_config() for name in family.named_configs]
    config_jsons = [json.loads(json.dumps(c)) for c in (transformers_config(family), *tiny, *named)]
    features_on = [{**{k: v is False or v for k, v in c.items()}, "sliding_window": 16} for c in config_jsons]
    return config_jsons + features_on


@pytest.mark.parametrize("architecture", FAMILIES, ids=lambda architecture: family_module(architecture))
def test_a_family_reads_the_keys_it_declares_and_no_other(architecture):
    """The declaration is the code's: over `config_jsons_of` the family, `config_from_hf` looks up every key it
    declares read and no other (beyond the shared ones)."""
    family = FAMILIES[architecture]
    looked_up: set[str] = set()
    for config_json in config_jsons_of(family):
        recording = KeysRead(config_json)
        family.config_from_hf(recording)
        looked_up |= recording.looked_up
    assert looked_up - SHARED_HF_KEYS == set(family.hf_keys_read)


def test_a_family_whose_code_stops_reading_a_declared_key_fails(monkeypatch):
    """Granite's declaration kept, but a config_from_hf that never looks at logits_scaling: the test above
    fails, naming the key."""
    granite = FAMILIES["GraniteForCausalLM"]
    kept = ("attention_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier")
    forgetful = dataclasses.replace(granite, config_from_hf=lambda hf: {key: hf.get(key) for key in kept})
    monkeypatch.setitem(FAMILIES, "GraniteForCausalLM", forgetful)
    with pytest.raises(AssertionError, match="logits_scaling"):
        test_a_family_reads_the_keys_it_declares_and_no_other("GraniteForCausalLM")


UNSUPPORTED_VALUES = {
    "mlp_bias": True,
    "hidden_act": "gelu",
    "use_bidirectional_attention": True,
    "resid_pdrop": 0.1,
    "clip_qkv": 8.0,
    "router_jitter_noise": 0.1,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [0],
}


@pytest.mark.parametrize(
    ("architecture", "key"),
    [
        (architecture, key)
        for architecture, family in FAMILIES.items()
        for key, ignored in family.hf_keys_ignored.items()
        if ignored.supported is not None
    ],
    ids=lambda value: family_module(value) if value in FAMILIES else value,
)
def test_a_value_that_changes_the_math_of_an_ignored_key_is_refused(architecture, key):
    """transformers' default config of the family converts; with the key at a value litsft does not compute
    (MLP biases, another activation, bidirectional attention, residual dropout) it is refused in one line
    that names the key, the value and the fix, instead of riding along in hf_extra."""
    family = FAMILIES[architecture]
    config_json = {**transformers_config(family), "architectures": [architecture]}
    Config.from_hf_config(config_json)
    with pytest.raises(LitsftError) as error:
        Config.from_hf_config({**config_json, key: UNSUPPORTED_VALUES[key]})
    message = str(error.value)
    assert message.startswith(f"{key}={json.dumps(UNSUPPORTED_VALUES[key])} in a {architecture} config.json")
    assert f"use a checkpoint whose config.json has {key}=" in message and "\n" not in message


def test_converting_a_checkpoint_with_an_unsupported_key_exits_2_in_one_line_and_writes_nothing(
    tmp_path, capsys
):
    """`litsft convert_from_hf` of a Llama checkpoint whose config.json has mlp_bias=true."""
    hf_dir = save_tiny_hf(tiny_hf_model("llama"), tmp_path / "hf")
    config_json = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config_json, "mlp_bias": True}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["convert_from_hf", str(hf_dir), "--out_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: mlp_bias=true in a LlamaForCausalLM config.json is not supported (litsft's MLP projections have "
        "no bias); use a checkpoint whose config.json has mlp_bias=false or leaves it out\n"
    )
    assert not (tmp_path / "out").exists()


def test_keys_litsft_does_not_translate_ride_along_unless_the_export_writes_them():
    """A harmless ignored key (initializer_range) and a key no family knows are written back on export; a value
    the export writes anyway (use_cache true, hidden_act silu) is not kept twice."""
    config_json = {
        **Config.from_name("tiny-granite").to_hf_config(),
        "initializer_range": 0.1,
        "a_key_of_a_newer_release": [1, 2],
        "use_cache": True,
    }
    config = Config.from_hf_config(config_json)
    assert config.hf_extra == {"initializer_range": 0.1, "a_key_of_a_newer_release": [1, 2]}
    assert config.to_hf_config() == config_json


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


@pytest.mark.parametrize("module", FAMILY_MODULES)
def test_a_family_modules_names_say_whether_they_hold_the_family_or_config_values(module):
    """The registered `Family` is `<FAMILY>_FAMILY`, a dict of `Config` values `<SERIES>_VALUES`: `GEMMA2` (a
    family) beside `QWEN3` (a dict) read alike."""
    namespace = vars(importlib.import_module(f"litsft.model.families.{module}"))
    config_fields = {f.name for f in dataclasses.fields(Config)}
    # Its own family and any it imports (Mixtral builds on Mistral).
    families = [name for name, value in namespace.items() if isinstance(value, Family)]
    values = [
        name
        for name, value in namespace.items()
        if name.isupper() and isinstance(value, dict) and value and set(value) <= config_fields
    ]
    assert families and all(name.endswith("_FAMILY") for name in families), families
    assert values and all(name.endswith("_VALUES") for name in values), values
    assert not [
        name for name in namespace if name.endswith(("_FAMILY", "_VALUES")) and name not in families + values
    ]


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


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "olmo2", "granite", *MOE_KINDS])
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


def test_granite_named_config_has_its_published_multipliers():
    """granite-3.1-2b-instruct's config.json (its source is cited in litsft/model/families/granite.py): the four
    multipliers, bos and eos, 131072 positions; attention scales by 1/64, not head_dim ** -0.5 (1/8)."""
    config = Config.from_name("granite-3.1-2b-instruct")
    multipliers = (
        config.embedding_multiplier,
        config.residual_multiplier,
        config.attention_multiplier,
        config.logits_scaling,
    )
    assert multipliers == (12.0, 0.22, 0.015625, 8.0)
    assert (config.bos_token_id, config.eos_token_id, config.max_position_embeddings) == (0, 0, 131072)
    assert (config.head_dim, config.attention_scale(), config.rms_norm_eps) == (64, 0.015625, 1e-5)


@pytest.mark.parametrize(
    "key", ["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"]
)
def test_each_granite_multiplier_changes_the_logits(tmp_path, key):
    """Each multiplier of the tiny Granite is read and used: set back to transformers' default (1.0), the
    transformers model and litsft's converted one change their logits together, and still agree."""
    reference = tiny_hf_model("granite")
    config = copy.deepcopy(reference.config)  # TINY_HF_MODELS' own stays as it is
    setattr(config, key, 1.0)
    hf_model = type(reference)(config).eval()
    hf_model.load_state_dict(reference.state_dict())
    convert_from_hf(save_tiny_hf(hf_model, tmp_path / "hf", tokenizer=False), tmp_path / "litsft")
    model = Transformer(Config.from_checkpoint(tmp_path / "litsft")).eval()
    model.load_state_dict(load_model_state_dict(tmp_path / "litsft"))
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    expected = assert_logits_match_transformers(model, hf_model, tokens)
    with torch.no_grad():
        assert (expected - reference(tokens).logits).abs().max() > 1e-3


# ---- mixtures of experts -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, change, message",
    [
        ("olmoe", dict(num_experts=None), "config.json lacks num_experts, which a mixture of experts needs"),
        (
            "mixtral",
            dict(num_local_experts=None, num_experts_per_tok=None),
            "config.json lacks num_local_experts and num_experts_per_tok, which a mixture of experts needs",
        ),
        (
            "mixtral",
            dict(num_local_experts=0),
            "config.json's num_local_experts is 0, but a mixture of experts",
        ),
        (
            "mixtral",
            dict(num_experts_per_tok=2.5),
            r"config.json's num_experts_per_tok is 2.5, but each token is routed to between 1 and "
            r"num_local_experts=4 experts; restore the original config.json, or set it in that range$",
        ),
    ],
)
def test_an_moe_config_json_without_its_experts_is_refused_in_one_line(kind, change, message):
    """A missing key and a value no model has are named by their config.json names. (The MoE keys litsft
    computes only at their published values, clip_qkv, router_jitter_noise, decoder_sparse_step and
    mlp_only_layers, are refused by the test of every ignored key above.)"""
    hf_config = TINY_HF_MODELS[kind][0].to_dict()
    Config.from_hf_config(hf_config)  # as published: accepted
    assert Config.from_hf_config({**hf_config, "num_experts_per_tok": 4.0}).experts_per_token == 4
    with pytest.raises(LitsftError, match=f"^{message}"):
        Config.from_hf_config({**hf_config, **change})


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_config_json_round_trips_and_transformers_reads_it(kind):
    """Every MoE key litsft reads comes back on export, and transformers builds the same model from it."""
    from transformers import AutoConfig

    hf_config = TINY_HF_MODELS[kind][0].to_dict()
    config = Config.from_hf_config(hf_config)
    exported = config.to_hf_config()
    assert Config.from_hf_config(exported) == config
    reread = AutoConfig.for_model(exported.pop("model_type"), **exported)
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "intermediate_size"):
        assert getattr(reread, key) == hf_config[key]
    assert getattr(reread, "num_experts", None) or reread.num_local_experts == 4


# ---- qwen2_moe -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout",
    [
        dict(decoder_sparse_step=1),
        dict(decoder_sparse_step=2),
        dict(decoder_sparse_step=3, mlp_only_layers=[5]),
        dict(decoder_sparse_step=1, mlp_only_layers=[0, 3, 9]),
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=4),
    ],
    ids=["every-layer", "step-2", "step-3-one-dense", "dense-listed", "window-without-layer-types"],
)
def test_qwen2_moe_routes_and_slides_the_layers_transformers_does(layout):
    """A config.json of 6 layers: litsft's model has a mixture of experts (with its shared expert) where
    transformers' Qwen2MoeForCausalLM has a sparse block and a dense MLP of intermediate_size elsewhere, and a
    window on the layers transformers slides, from a config.json without layer_types (old hub files) too; its
    export reads back the same model."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tiny = TINY_HF_MODELS["qwen2-moe"][0].to_dict()
    config_json = {key: value for key, value in tiny.items() if key != "layer_types"}
    config_json.update({"num_hidden_layers": 6, "use_sliding_window": False, "mlp_only_layers": [], **layout})
    hf_config = Qwen2MoeConfig(**config_json)
    config = Config.from_hf_config(config_json)
    with torch.device("meta"):
        hf_layers = Qwen2MoeForCausalLM(hf_config).model.layers
        blocks = Transformer(config).blocks
    hf_sparse = [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf_layers]
    assert [hasattr(block.mlp, "router") for block in blocks] == hf_sparse
    assert [hasattr(block.mlp, "shared_expert") for block in blocks] == hf_sparse
    assert [block.mlp.gate_proj.out_features for block, sparse in zip(blocks, hf_sparse) if not sparse] == [
        128
    ] * hf_sparse.count(False)
    windows = [SLIDING_WINDOW if kind == "sliding_attention" else None for kind in hf_config.layer_types]
    assert [config.attention_window(i) for i in range(6)] == windows
    assert Config.from_hf_config(config.to_hf_config()) == config
    assert Qwen2MoeConfig(**config.to_hf_config()).layer_types == hf_config.layer_types


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(decoder_sparse_step=0),
            "config.json's decoder_sparse_step is 0, but every how many layers the MLP is a mixture of experts is "
            "a whole number from 1; restore the original config.json",
        ),
        (
            dict(shared_expert_intermediate_size=0),
            "config.json's shared_expert_intermediate_size is 0, but litsft builds Qwen2-MoE's shared expert at "
            "least 1 wide, as the published models have it; restore the original config.json",
        ),
        (
            dict(mlp_only_layers="1"),
            "config.json's mlp_only_layers is '1', but it lists the indices of the layers with a dense MLP; "
            "restore the original config.json",
        ),
    ],
)
def test_a_qwen2_moe_layout_litsft_does_not_build_is_refused_in_one_line(change, message):
    """decoder_sparse_step 0 divides by zero in transformers; a shared expert 0 wide still has a gate and empty
    projections in transformers' weights, which litsft has no place for; mlp_only_layers is a list of layers."""
    config_json = TINY_HF_MODELS["qwen2-moe"][0].to_dict()
    with pytest.raises(LitsftError) as error:
        Config.from_hf_config({**config_json, **change})
    assert str(error.value) == message
