"""What a model family is to litsft: a `Family` spec (its Hugging Face config translation, with every config.json
key it reads and every one it knowingly ignores, its weight-name map, the block variant it needs, its named
configs) and the registry the rest of the code looks it up in.

Nothing here imports torch (but stacking experts' tensors, when a conversion does it) or litsft.model.config: a
family is data and small functions over plain dicts, so that litsft.model.config (the one `Config` dataclass) can
sit on top of every family.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from litsft.errors import LitsftError


@dataclass(frozen=True)
class Layout:
    """How a hub tensor lays out a litsft parameter's values differently (gpt-oss's experts: transposed, gate
    and up interleaved): two inverse rearrangements (reshapes, transposes, slices) of the same elements, so the
    round trip is bit-exact. Shapes are checked by applying `to_litsft` to a tensor without data."""

    to_litsft: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]


@dataclass(frozen=True)
class WeightMap:
    """litsft parameter names <-> Hugging Face tensor names; "{i}" stands for the layer index.

    `names` maps one litsft name to one HF name. `fused` maps one HF tensor that several litsft parameters
    share (Phi-3's `qkv_proj` holds q, k and v; its `gate_up_proj` gate and up) to those parameters, in the
    order they are concatenated along dim 0: importing splits it by the litsft shapes, exporting concatenates
    them again, so the round trip is bit-exact. `experts` is the other way round: one litsft tensor that
    stacks every expert of a mixture-of-experts layer (E, rows, cols) -> the hub's per-expert tensors it holds,
    "{e}" standing for the expert index; expert e's slice is its parts concatenated along dim 0 (gate rows,
    then up rows). `ignored` are HF names litsft recomputes and drops (RoPE's inverse frequencies that old
    transformers versions saved). `layouts`: litsft names (of `names`) whose hub tensor is laid out otherwise,
    with the `Layout` that converts it."""

    names: Mapping[str, str]
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    experts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    layouts: Mapping[str, Layout] = field(default_factory=dict)

    def layout(self, litsft_name: str) -> Layout | None:
        """The `Layout` of a litsft parameter whose hub tensor is laid out otherwise; None for the others."""
        return self.layouts.get(_template_of(litsft_name))

    def hf_name(self, litsft_name: str) -> str:
        """The Hugging Face name of a litsft parameter name (for a fused part: the fused tensor's name; for
        stacked experts: the first part's name with "*" for the expert)."""
        name = _rename(litsft_name, self.names) or _rename(litsft_name, self._fused_of_part)
        if name is None:
            parts = _rename_all(litsft_name, self.experts)
            name = parts[0].replace("{e}", "*") if parts else None
        if name is None:
            raise KeyError(f"no Hugging Face name for litsft parameter {litsft_name!r}")
        return name

    def expert_part(self, hf_name: str) -> tuple[str, int, int, int] | None:
        """For a hub per-expert tensor: (the litsft tensor stacking it, its expert, which of that expert's
        parts it is, how many parts an expert has); None for any other name."""
        for pattern, litsft_template, part, parts in self._expert_patterns:
            match = pattern.fullmatch(hf_name)
            if match:
                expert = match.group("e")
                return (
                    litsft_template.format(i=match.group("i")),
                    -1 if expert == "*" else int(expert),
                    part,
                    parts,
                )
        return None

    def litsft_names(self, hf_name: str) -> tuple[str, ...] | None:
        """The litsft names a Hugging Face tensor holds (several for a fused one, the stacked tensor for one
        expert's part), or None when litsft has no such parameter."""
        single = _rename(hf_name, self._litsft_of_hf)
        if single is not None:
            return (single,)
        expert_part = self.expert_part(hf_name)
        if expert_part is not None:
            return (expert_part[0],)
        match = _LAYER_INDEX.search(hf_name)
        parts = self.fused.get(_template_of(hf_name))
        if parts is None:
            return None
        return tuple(part.format(i=match.group(1)) if match else part for part in parts)

    def expert_names(self, litsft_name: str, expert: int) -> tuple[str, ...]:
        """The Hugging Face names of expert `expert`'s parts of the stacked tensor `litsft_name`, in order."""
        return tuple(template.format(e=expert) for template in _rename_all(litsft_name, self.experts))

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(pattern, hf_name) for pattern in self.ignored)

    def from_hf(
        self, hf_tensors: Iterable[tuple[str, Any]], shapes: Mapping[str, tuple[int, ...]]
    ) -> Iterator[tuple[str, Any]]:
        """HF-named tensors -> litsft-named ones, fused tensors split by the litsft `shapes` of their parts, the
        experts of a layer stacked once all of them have passed."""
        pending: dict[str, dict[tuple[int, int], Any]] = {}
        for hf_name, tensor in hf_tensors:
            expert_part = self.expert_part(hf_name)
            if expert_part is not None:
                name, expert, part, parts = expert_part
                held = pending.setdefault(name, {})
                held[expert, part] = tensor
                if len(held) == shapes[name][0] * parts:
                    yield name, _stack_experts(held, shapes[name][0], parts)
                    del pending[name]
                continue
            names = self.litsft_names(hf_name)
            if names is None:
                raise KeyError(f"no litsft name for Hugging Face tensor {hf_name!r}")
            if len(names) == 1:
                layout = self.layout(names[0])
                yield names[0], layout.to_litsft(tensor) if layout is not None else tensor
                continue
            yield from zip(names, tensor.split([shapes[name][0] for name in names], dim=0))
        if pending:
            raise KeyError(f"experts of stacked tensors never came: {sorted(pending)}")

    def to_hf(
        self, named_tensors: Iterable[tuple[str, Any]], concatenate: Callable[[list[Any]], Any]
    ) -> Iterator[tuple[str, Any]]:
        """litsft-named tensors -> HF-named ones; the parts of a fused tensor are held until all have passed,
        then joined with `concatenate` (torch.cat along dim 0)."""
        pending: dict[str, dict[str, Any]] = {}
        for name, tensor in named_tensors:
            single = _rename(name, self.names)
            if single is not None:
                layout = self.layout(name)
                yield single, layout.to_hf(tensor) if layout is not None else tensor
                continue
            expert_parts = _rename_all(name, self.experts)
            if expert_parts:
                for expert, slices in enumerate(tensor):  # (rows, cols) of expert e
                    for template, part in zip(expert_parts, slices.chunk(len(expert_parts), dim=0)):
                        yield template.format(e=expert), part
                continue
            fused_name = self.hf_name(name)
            parts = self.litsft_names(fused_name)
            assert parts is not None
            held = pending.setdefault(fused_name, {})
            held[name] = tensor
            if len(held) == len(parts):
                yield fused_name, concatenate([held[part] for part in parts])
                del pending[fused_name]
        if pending:
            missing = [
                part
                for fused in pending
                for part in self.litsft_names(fused) or ()
                if part not in pending[fused]
            ]
            raise KeyError(f"parts of fused tensors never came: {missing}")

    @cached_property
    def _litsft_of_hf(self) -> dict[str, str]:
        return {hf: litsft for litsft, hf in self.names.items()}

    @cached_property
    def _fused_of_part(self) -> dict[str, str]:
        return {part: fused for fused, parts in self.fused.items() for part in parts}

    @cached_property
    def _expert_patterns(self) -> list[tuple[re.Pattern[str], str, int, int]]:
        """(the regex of one per-expert HF name, its litsft template, its part, the parts per expert)."""
        patterns = []
        for litsft_template, hf_templates in self.experts.items():
            for part, hf_template in enumerate(hf_templates):
                regex = (
                    re.escape(hf_template)
                    .replace(r"\{i\}", r"(?P<i>\d+)")
                    .replace(r"\{e\}", r"(?P<e>\d+|\*)")
                )
                patterns.append((re.compile(regex), litsft_template, part, len(hf_templates)))
        return patterns


def _stack_experts(held: Mapping[tuple[int, int], Any], num_experts: int, parts: int) -> Any:
    """Expert e's parts joined along dim 0, the experts stacked along a new dim 0: (E, rows, cols)."""
    import torch  # only conversion stacks experts; the registry stays torch-free

    return torch.stack([torch.cat([held[e, p] for p in range(parts)]) for e in range(num_experts)])


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _template_of(name: str) -> str:
    return _LAYER_INDEX.sub(".{i}.", name, count=1)


def _rename_all(name: str, templates: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Translate `name` into each of the templates it maps to (the layer filled in, "{e}" kept), or ()."""
    match = _LAYER_INDEX.search(name)
    targets = templates.get(_template_of(name), ())
    return tuple(target.replace("{i}", match.group(1)) if match else target for target in targets)


def _rename(name: str, templates: Mapping[str, str]) -> str | None:
    """Translate `name` with `templates`, or None when no template matches."""
    match = _LAYER_INDEX.search(name)
    target = templates.get(_template_of(name))
    if target is None:
        return None
    return target.format(i=match.group(1)) if match else target


# The decoder layout Llama set and most families keep: litsft name -> Hugging Face name.
LLAMA_WEIGHT_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.q_proj.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blocks.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.k_proj.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blocks.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.v_proj.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blocks.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.o_proj.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blocks.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# The MoE layout Qwen2-MoE set and OLMoE and Qwen3-MoE keep: a router (`mlp.gate`) and per-expert SwiGLU MLPs.
MOE_WEIGHT_NAMES: dict[str, str] = {
    **{litsft: hf for litsft, hf in LLAMA_WEIGHT_NAMES.items() if ".mlp." not in litsft},
    "blocks.{i}.mlp.router.weight": "model.layers.{i}.mlp.gate.weight",
}
MOE_EXPERT_NAMES: dict[str, tuple[str, ...]] = {
    "blocks.{i}.mlp.experts.gate_up_proj": (
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    ),
    "blocks.{i}.mlp.experts.down_proj": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
}
ROUTED_EXPERT_KEYS = frozenset({"num_experts_per_tok", "router_aux_loss_coef"})
"""The config.json keys `routed_experts_from_hf` reads besides the experts' count."""
LONG_ROPE_TYPES = ("longrope", "su")
"""LongRoPE's rope_scaling types (Phi-3 128k, Phi-4-mini); "su" is the name Phi-3's first config.json files gave it."""


def routed_experts_from_hf(hf_config: Mapping[str, Any], count_keys: tuple[str, ...]) -> dict[str, Any]:
    """The `Config` fields every MoE family reads alike: the experts (the first of `count_keys` that is set:
    the hub's Qwen3-MoE and OLMoE files say `num_experts`, Mixtral's and transformers 5's `num_local_experts`),
    how many each token takes, the load-balancing loss's coefficient. A key that is missing, and one whose value
    no model has, are refused by their config.json names."""
    counts = {
        key: hf_config.get(key) for key in count_keys
    }  # every key looked up: the declaration reads them all
    given = [key for key, count in counts.items() if count is not None]
    count_key = next((key for key in given if counts[key]), given[0] if given else None)
    per_token = hf_config.get("num_experts_per_tok")
    missing = ([] if count_key else [" or ".join(count_keys)]) + (
        [] if per_token is not None else ["num_experts_per_tok"]
    )
    if missing:
        raise LitsftError(
            f"config.json lacks {' and '.join(missing)}, which a mixture of experts needs; restore the original "
            "config.json"
        )
    experts = counts[count_key]
    if not _is_count(experts) or experts < 1:
        raise LitsftError(
            f"config.json's {count_key} is {experts!r}, but a mixture of experts has at least one expert in each "
            "layer; restore the original config.json (its count is that of the experts in the weights)"
        )
    if not _is_count(per_token) or not 1 <= per_token <= experts:
        raise LitsftError(
            f"config.json's num_experts_per_tok is {per_token!r}, but each token is routed to between 1 and "
            f"{count_key}={int(experts)} experts; restore the original config.json, or set it in that range"
        )
    return {
        "num_experts": int(experts),
        "experts_per_token": int(per_token),
        "router_aux_loss_coef": float(hf_config.get("router_aux_loss_coef") or 0.0),
    }


def _is_count(value: Any) -> bool:
    """Whether a config.json value is a whole number (JSON may spell 8 as 8.0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


LLAMA_WEIGHTS = WeightMap(
    LLAMA_WEIGHT_NAMES, ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
)


SHARED_HF_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "_name_or_path",
        "transformers_version",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_dropout",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "dtype",
    }
)
"""config.json keys litsft.model.config.Config.from_hf_config reads for every family (transformers_version: the
export names no version; the rest become `Config` fields). A family declares the others it reads."""


@dataclass(frozen=True)
class IgnoredKey:
    """A config.json key a family does not translate, and why that is safe."""

    why: str
    supported: tuple[Any, ...] | None = None
    """The values under which transformers' model computes what litsft's does (transformers' default first);
    conversion refuses a config.json with any other. None: no value changes the math."""


def harmless(why: str) -> IgnoredKey:
    """A key no value of which changes what the model computes."""
    return IgnoredKey(why)


def unsupported(why: str, *supported: Any) -> IgnoredKey:
    """A key litsft computes with only at `supported` values: any other is refused on conversion."""
    return IgnoredKey(why, supported)


DECODER_IGNORED: dict[str, IgnoredKey] = {
    "initializer_range": harmless(
        "the spread of transformers' random init: converted weights are loaded, and litsft's pretraining draws "
        "its own (litsft.model.network.transformer.Transformer.initial_value)"
    ),
    "use_cache": harmless("whether transformers' generate keeps a KV cache; litsft's generation always does"),
    "pad_token_id": harmless(
        "the id transformers' generate pads batched prompts with; it changes no logit of a real token"
    ),
    "hidden_act": unsupported("litsft's MLP is SwiGLU", "silu"),
    "mlp_bias": unsupported("litsft's MLP projections have no bias", False),
}
"""The keys most transformers decoder configs have and litsft does not translate; a family declares them with
its own (`{**DECODER_IGNORED, ...}`)."""
MOE_IGNORED: dict[str, IgnoredKey] = {
    "output_router_logits": harmless(
        "whether transformers returns the router logits and adds the load-balancing loss; litsft adds it in "
        "every training step (--train.router_aux_loss_coef 0 turns it off) and its logits do not depend on it"
    ),
}
"""The keys every mixture-of-experts family ignores, beside DECODER_IGNORED."""


@dataclass(frozen=True)
class Family:
    """Everything that differs between model families. The shared `Config` fields are read from and written
    to config.json by litsft.model.config; a family adds its own.

    Attributes:
        architecture: The `architectures` entry of its config.json, e.g. "LlamaForCausalLM".
        model_type: The `model_type` of its config.json, e.g. "llama".
        config_from_hf: config.json dict -> the `Config` fields only this family reads.
        hf_from_config: a `Config` -> the config.json keys only this family writes.
        hf_keys_read: The config.json keys `config_from_hf` reads (SHARED_HF_KEYS are read for every family).
        hf_keys_ignored: The keys of its config.json (transformers' config class for the architecture) that
            it does not read, each with why; those with `supported` values are refused at any other value.
            tests/test_model_families.py holds read and ignored together against transformers' class: a key
            of the class in neither fails the test. Keys in neither are kept in `Config.hf_extra`.
        weights: Its weight-name map.
        block: The block variant litsft.model.network.transformer builds for it (a key of litsft.model.network.transformer.BLOCK_VARIANTS).
        named_configs: name -> `Config` field values of each published model, with its source cited in the
            family's module.
    """

    architecture: str
    model_type: str
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    hf_from_config: Callable[[Any], dict[str, Any]]
    hf_keys_read: frozenset[str]
    hf_keys_ignored: Mapping[str, IgnoredKey]
    weights: WeightMap = LLAMA_WEIGHTS
    block: str = "pre_norm"
    named_configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def refuse_unsupported(self, hf_config: Mapping[str, Any]) -> None:
        """Refuse a config.json that sets an ignored key to a value under which transformers' model computes
        something litsft's does not: converting it would give other logits (and write the key back)."""
        for key, ignored in self.hf_keys_ignored.items():
            if ignored.supported is None or key not in hf_config:
                continue
            value = hf_config[key]
            if value not in ignored.supported:
                allowed = " or ".join(json.dumps(s) for s in ignored.supported)
                raise LitsftError(
                    f"{key}={json.dumps(value)} in a {self.architecture} config.json is not supported "
                    f"({ignored.why}); use a checkpoint whose config.json has {key}={allowed} or leaves it out"
                )


FAMILIES: dict[str, Family] = {}
"""architecture -> its family, in registration order."""


def register_family(family: Family) -> Family:
    if family.architecture in FAMILIES:
        raise ValueError(f"family {family.architecture} is registered twice")
    FAMILIES[family.architecture] = family
    return family


def family_of(architecture: str) -> Family:
    """The registered family of an HF architecture name (what `Config.hf_architecture` holds)."""
    if architecture not in FAMILIES:
        raise LitsftError(f"unsupported architecture {architecture!r}; litsft supports {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def family_of_hf_config(hf_config: Mapping[str, Any]) -> Family:
    """The family of a config.json: by its `architectures`, else by its `model_type`."""
    architectures = hf_config.get("architectures") or []
    if architectures:
        return family_of(architectures[0])
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    raise LitsftError(f"unsupported architecture {model_type!r}; litsft supports {', '.join(FAMILIES)}")


def published(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, **family: Any
) -> tuple[str, dict[str, Any]]:
    """One published shape as `Config` field values; `family` holds what the whole family shares."""
    shape = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
    )
    return name, dict(name=name, **shape, **family)
