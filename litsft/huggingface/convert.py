"""Every translation of a litsft folder to or from another layout, streaming one tensor at a time:
Hugging Face -> litsft model folder (`convert_from_hf`), litsft model folder -> Hugging Face
(`convert_to_hf`), and a LoRA folder -> a merged litsft model folder (`merge_lora`), a merged Hugging
Face checkpoint, or a PEFT adapter (`convert_to_hf --lora_format`). The tensor names are the model family's
(`Family.weights`, litsft.model.families).

Everything is checked before anything is written (architecture, files, tensor names and shapes, read from
file headers, the tokenizer), and the output is built in a staging directory that is renamed at the end,
so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from litsft.checkpoint.checkpoint_dirs import (
    VALIDATION_PROMPTS_FILE,
    is_step_checkpoint,
    out_dir_given_as_a_model,
)
from litsft.checkpoint.lora_folder import LoRAFolder, is_lora_folder, read_lora_folder
from litsft.checkpoint.model_cache import open_step_checkpoint
from litsft.checkpoint.model_folder import (
    WeightsFingerprint,
    copy_tokenizer_files,
    iter_model_tensors,
    model_tensor_shapes,
    read_manifest,
    save_model_folder,
)
from litsft.checkpoint.weight_files import (
    DEFAULT_MAX_SHARD_SIZE,
    iter_tensors,
    save_safetensors,
    tensor_infos,
    weight_file_map,
    write_safetensors,
)
from litsft.data.tokenizer import check_tokenizer_fits, read_tokenizer_file
from litsft.errors import LitsftError
from litsft.huggingface.export_check import CHEAP_PARAMETERS, check_export, check_prompts
from litsft.huggingface.mxfp4 import dequantized, dequantized_shape, packed_tensors
from litsft.model.accounting.sizes import num_parameters
from litsft.model.config import CONFIG_FILENAME, Config, DType
from litsft.model.families import FAMILIES, WeightMap, family_of
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import EXPERT_ADAPTERS, iter_merged_tensors, merged_config, split_adapter_name
from litsft.model.lora.variants import adapter_variant
from litsft.model.network.transformer import Transformer
from litsft.model.precision.quantization import iter_nf4_base
from litsft.runtime.files import publish_atomically, read_json, write_json

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_ADAPTER_NAME = "adapter_model.safetensors"
# Where the hub cache keeps a model: .../models--<org>--<name>/snapshots/<revision>.
_HUB_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def weight_map(config: Config) -> WeightMap:
    """The Hugging Face weight names of `config`'s family."""
    return family_of(config.hf_architecture).weights


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """litsft name -> shape of every tensor a checkpoint of `config` stores (a tied lm_head is not stored)."""
    with torch.device("meta"):  # shapes only: no memory, even for a 70B config
        model = Transformer(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def convert_from_hf(
    hf_dir: Path,
    out_dir: Path | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    hf_model_id: str | None = None,
) -> None:
    """Convert a Hugging Face checkpoint of a registered family (litsft.model.families) into a litsft checkpoint.

    Args:
        hf_dir: Directory with config.json, the weights (safetensors or .bin, single or sharded) and the
            tokenizer files.
        out_dir: Where to write the litsft checkpoint; must be absent or empty.
            Default: checkpoints/<name of hf_dir>.
        dtype: Store the weights in this dtype; "auto" keeps the dtype they have.
        max_shard_size: Split the weights into files of at most this size, e.g. 5GB, 500MB, 2GiB.
        hf_model_id: The Hugging Face hub id of the checkpoint (e.g. meta-llama/Llama-3.2-1B), recorded so
            that PEFT exports of adapters trained on it name their base. Default: read from a hub cache
            path (.../models--<org>--<name>/snapshots/...), else the path of hf_dir.
    """
    hf_dir = Path(hf_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path("checkpoints") / hf_dir.resolve().name
    convert_hf_directory(hf_dir, out_dir, dtype=dtype, max_shard_size=max_shard_size, hf_model_id=hf_model_id)
    print(f"Saved litsft checkpoint to {out_dir}")


def convert_hf_directory(
    hf_dir: Path,
    out_dir: Path,
    name: str | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    extra_files: dict[str, str] | None = None,
    hf_model_id: str | None = None,
) -> None:
    """What `convert_from_hf` does, for callers that know the model's name (a hub id; default: the directory's
    name) or add files to the checkpoint (where it came from), written before the checkpoint is published.
    The manifest records where the weights came from: `hf_model_id`, else `name`, else a hub id read from a
    hub cache path, else the directory."""
    config = _read_hf_config(hf_dir, name)
    names = _check_hf_tensors(hf_dir, config)  # HF name -> the litsft names it holds
    has_tokenizer = _check_hf_tokenizer(hf_dir, config)
    if dtype != "auto":
        config.torch_dtype = dtype
    with publish_atomically(out_dir, "the converted checkpoint") as tmp_dir:
        hf_tensors = dequantized(iter_tensors(hf_dir, names))  # MXFP4 experts (gpt-oss) as bf16
        tensors = weight_map(config).from_hf(hf_tensors, expected_shapes(config))
        source = hf_model_id or name or _hub_id_of_cache_path(hf_dir) or str(hf_dir.resolve())
        save_model_folder(_cast(tensors, dtype), config, tmp_dir, hf_dir, max_shard_size, hf_source=source)
        for file_name, text in (extra_files or {}).items():
            (tmp_dir / file_name).write_text(text)
    if not has_tokenizer:
        print(
            f"note: {hf_dir} has no tokenizer.json, so neither has {out_dir}: training and generate need one; "
            f"copy it into {out_dir} (transformers' AutoTokenizer.save_pretrained writes it)",
            file=sys.stderr,
        )


def convert_to_hf(
    checkpoint_dir: Path,
    out_dir: Path | None = None,
    dtype: DType = "auto",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    lora_format: Literal["merged", "peft"] = "merged",
    check: Literal["auto", "on", "off"] = "auto",
) -> None:
    """Convert a litsft checkpoint directory into a Hugging Face checkpoint that transformers loads as is.

    Args:
        checkpoint_dir: A litsft checkpoint directory (litsft_config.json and model*.safetensors), or a LoRA
            checkpoint written by finetune_lora (lora_config.json and adapter.safetensors).
        out_dir: Where to write the Hugging Face checkpoint; must be absent or empty.
            Default: <checkpoint_dir>-hf next to checkpoint_dir.
        dtype: Write the weights in this dtype; "auto" keeps the dtype they have.
        max_shard_size: Split the weights into files of at most this size, e.g. 5GB, 500MB, 2GiB.
        lora_format: For a LoRA checkpoint: "merged" writes the base model with the adapters folded in,
            "peft" writes a PEFT adapter (adapter_config.json, adapter_model.safetensors) for the HF base model.
        check: After writing, answer a few prompts greedily with litsft and with the export through
            transformers, with the chat template, and name what differs in one line (template, tokenizer,
            end of turn, weights). "auto": when transformers is installed and the model has at most 2B
            parameters (two fp32 copies in host memory), a difference reported as a warning; "on": always, a
            difference an error (the export stays on disk); "off": never. A PEFT adapter is not checked.
    """
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint_dir.with_name(checkpoint_dir.name + "-hf")
    checkpoint_dir = open_step_checkpoint(checkpoint_dir)
    if is_lora_folder(checkpoint_dir):
        export_lora_to_hf(checkpoint_dir, out_dir, lora_format, dtype)
        print(f"Saved Hugging Face {lora_format} export of the LoRA checkpoint to {out_dir}")
        if lora_format == "merged":
            base_config = Config.from_checkpoint(read_lora_folder(checkpoint_dir).base_dir)
            report_export_check(checkpoint_dir, out_dir, base_config, check)
        return
    if lora_format == "peft":
        raise LitsftError(
            f"--lora_format peft: {checkpoint_dir} is a full model, not a LoRA checkpoint (it has no "
            "lora_config.json); drop --lora_format, or pass the final/ directory of a finetune_lora run"
        )
    run_out_dir = out_dir_given_as_a_model(checkpoint_dir)
    if run_out_dir is not None and not (checkpoint_dir / CONFIG_FILENAME).is_file():
        raise LitsftError(run_out_dir)
    config = Config.from_checkpoint(checkpoint_dir)
    if config.router_bias_update_rate:
        raise LitsftError(
            f"{checkpoint_dir} was trained with --train.router_bias_update_rate: its routers' balancing biases "
            f"decide which experts each token goes to, and transformers' {config.hf_architecture} has no such "
            "bias, so the export would route differently; use the litsft checkpoint (litsft generate), or "
            "train with --train.router_bias_update_rate 0"
        )
    _check_checkpoint_tensors(checkpoint_dir, config)
    if dtype != "auto":
        config.torch_dtype = dtype
    with publish_atomically(out_dir, "the Hugging Face checkpoint") as tmp_dir:
        tensors = _cast(iter_model_tensors(checkpoint_dir), dtype)
        write_hf_checkpoint(tensors, config, tmp_dir, checkpoint_dir, max_shard_size)
    print(f"Saved Hugging Face checkpoint to {out_dir}")
    report_export_check(checkpoint_dir, out_dir, config, check)


def report_export_check(checkpoint_dir: Path, out_dir: Path, config: Config, check: str) -> None:
    """Run the export check (litsft.huggingface.export_check) as `check` says and print its verdict."""
    if check == "off":
        return
    installed = importlib.util.find_spec("transformers") is not None
    if check == "auto" and (not installed or num_parameters(config) > CHEAP_PARAMETERS):
        return
    if not installed:
        raise LitsftError(
            "--check on loads the export with transformers: pip install transformers, or pass --check off"
        )
    prompts = check_prompts(checkpoint_dir)
    difference = check_export(checkpoint_dir, out_dir, prompts)
    if difference is None:
        which = (
            "of the run's validation prompts"
            if (checkpoint_dir / VALIDATION_PROMPTS_FILE).is_file()
            else "prompts"
        )
        print(f"Export check: transformers answers {len(prompts)} {which} as litsft does, token for token")
    elif check == "on":
        raise LitsftError(
            f"the export differs from the litsft model in its {difference} (the export is in {out_dir})"
        )
    else:
        print(f"Warning: the export differs from the litsft model in its {difference}", file=sys.stderr)


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: Config,
    out_dir: Path,
    tokenizer_source_dir: Path | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write litsft-named tensors as a Hugging Face checkpoint into an existing `out_dir`: config.json,
    generation_config.json, safetensors weights in HF names, and the tokenizer files."""
    out_dir = Path(out_dir)
    write_json(out_dir / "config.json", config.to_hf_config())
    if tokenizer_source_dir is not None:
        copy_tokenizer_files(tokenizer_source_dir, out_dir)
    if not (out_dir / "generation_config.json").is_file():
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        generation = {key: value for key, value in generation.items() if value is not None}
        write_json(out_dir / "generation_config.json", generation)
    # transformers re-ties lm_head to the embeddings itself; a stored copy would only cost disk.
    stored = (
        (name, tensor)
        for name, tensor in named_tensors
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    write_safetensors(weight_map(config).to_hf(stored, torch.cat), out_dir, max_shard_size)


# ---- LoRA folders ----------------------------------------------------------------------------------------
def merge_lora(checkpoint_dir: Path, out_dir: Path | None = None, dtype: DType = "auto") -> None:
    """Fold a LoRA checkpoint's adapters into its base weights and write a plain litsft checkpoint.

    Args:
        checkpoint_dir: A LoRA checkpoint directory written by finetune_lora (lora_config.json,
            adapter.safetensors); its lora_config.json names the base checkpoint.
        out_dir: Where to write the merged checkpoint; default `<checkpoint_dir>/merged`. Must not exist or
            be empty.
        dtype: Write the weights in this dtype; "auto" keeps the base checkpoint's. Adapters trained on an
            NF4 base (--quantize nf4) are folded into the dequantized NF4 weights they were trained with.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if out_dir is None:
        # Beside a step checkpoint, not in it: a file it was not written with would make it damaged.
        out_dir = (
            checkpoint_dir.with_name(checkpoint_dir.name + "-merged")
            if is_step_checkpoint(checkpoint_dir)
            else checkpoint_dir / "merged"
        )
    checkpoint_dir = open_step_checkpoint(checkpoint_dir)
    folder = read_lora_folder(checkpoint_dir)
    with publish_atomically(out_dir, "the merged checkpoint") as tmp_dir:
        with _merged_base(folder, dtype) as (tensors, config):
            save_model_folder(tensors, config, tmp_dir, tokenizer_source_dir=checkpoint_dir)
    print(f"Saved merged checkpoint to {out_dir}")


def export_lora_to_hf(
    lora_checkpoint_dir: Path,
    out_dir: Path,
    format: Literal["merged", "peft"] = "merged",
    dtype: DType = "auto",
) -> None:
    """Export a LoRA checkpoint for Hugging Face: "merged" writes a plain transformers checkpoint with the
    adapters folded in, "peft" writes a PEFT adapter for the original base model.

    Args:
        lora_checkpoint_dir: A LoRA checkpoint directory written by finetune_lora.
        out_dir: Where to write; must not exist or be empty.
        format: merged (a full model) or peft (adapter_config.json + adapter_model.safetensors).
        dtype: The merged model's dtype; "auto" keeps the base checkpoint's.
    """
    if format == "peft":
        export_peft_adapter(lora_checkpoint_dir, out_dir)
        return
    folder = read_lora_folder(lora_checkpoint_dir)
    with publish_atomically(Path(out_dir), "the merged Hugging Face checkpoint") as tmp_dir:
        with _merged_base(folder, dtype) as (tensors, config):
            write_hf_checkpoint(tensors, config, tmp_dir, Path(lora_checkpoint_dir))


@contextmanager
def _merged_base(
    folder: LoRAFolder, dtype: DType = "auto"
) -> Iterator[tuple[Iterator[tuple[str, torch.Tensor]], Config]]:
    """The base's tensors with the adapters folded in (into the dequantized NF4 weights for QLoRA), in
    `dtype` ("auto": the base's), and the merged model's config. The base's weights are fingerprinted as
    they stream past and checked when the block ends, before anything is published: a base that changed
    since training is refused (early, when its manifest already says so)."""
    folder.check_base_manifest()
    config = Config.from_checkpoint(folder.base_dir)
    fingerprint = WeightsFingerprint()
    base_tensors = fingerprint.passing(iter_model_tensors(folder.base_dir))
    stored_dtypes = {name: dtype for name, (_, dtype) in model_tensor_shapes(folder.base_dir).items()}
    if folder.base_quantization == "nf4":
        base_tensors = iter_nf4_base(base_tensors, folder.adapters)
    merged = iter_merged_tensors(base_tensors, folder.adapters, folder.config, config.tie_word_embeddings)
    out_config = merged_config(config, folder.config)
    if dtype != "auto":
        out_config = replace(out_config, torch_dtype=dtype)
    yield _cast_to(merged, dtype, stored_dtypes), out_config
    folder.check_base(fingerprint.hexdigest())


def peft_adapter_tensors(
    adapters: Mapping[str, torch.Tensor], config: Config, lora_config: LoRAConfig
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """litsft adapters -> the tensors of a PEFT adapter for the Hugging Face model, in PEFT's names
    (`blocks.0.attn.o_proj.lora_A.weight` -> `base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight`),
    and for each fused Hugging Face module, how many litsft adapters it joins.

    A fused tensor (Phi-3's qkv_proj holds q, k and v) is one module to PEFT, with one A and one B. The
    adapters of its n adapted parts are exactly one LoRA of rank n * r: A stacks their A's (n * r, in); B (out,
    n * r) holds each part's B (out_i, r) in that part's rows and its own r columns, zero elsewhere (an unadapted
    part's rows stay zero), so that B A stacks each part's B_i A_i as the weight stacks the parts. With alpha
    n * alpha as well (`_peft_config`), PEFT's scaling alpha / rank is litsft's."""
    weights, shapes = weight_map(config), expected_shapes(config)
    variant = adapter_variant(lora_config.variant)
    modules_of: dict[str, list[str]] = {}  # HF weight -> the litsft modules with adapters it holds
    own_tensors = [n for n in adapters if split_adapter_name(n)[1] not in ("lora_A.weight", "lora_B.weight")]
    for name in adapters:
        module = split_adapter_name(name)[0]
        held = modules_of.setdefault(weights.hf_name(f"{module}.weight"), [])
        if module not in held:
            held.append(module)
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[str, int] = {}
    for hf_weight, modules in modules_of.items():
        parts = [part.removesuffix(".weight") for part in weights.litsft_names(hf_weight) or ()]
        adapted = [part for part in parts if part in modules]
        lora_A = torch.cat([adapters[f"{part}.lora_A.weight"] for part in adapted])  # (n * r, in)
        if len(parts) == 1:
            lora_B = adapters[f"{adapted[0]}.lora_B.weight"]
        elif own_tensors:
            # E.g. DoRA's magnitude for the fused module would need the row norms of its unadapted parts' weights.
            raise LitsftError(
                f"{lora_config.variant} adapters on the fused Hugging Face module {hf_weight!r} have no PEFT form "
                "here; export with --lora_format merged instead"
            )
        else:
            rank = lora_A.shape[0] // len(adapted)
            lora_B = lora_A.new_zeros(sum(shapes[f"{part}.weight"][0] for part in parts), lora_A.shape[0])
            row = column = 0
            for part in parts:
                rows = shapes[f"{part}.weight"][0]
                if part in adapted:
                    lora_B[row : row + rows, column : column + rank] = adapters[f"{part}.lora_B.weight"]
                    column += rank
                row += rows
            fused[_module_name(hf_weight)] = len(adapted)
        prefix = f"base_model.model.{hf_weight.removesuffix('.weight')}"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = lora_A, lora_B
        for name in own_tensors:  # the variant's own tensors (DoRA's magnitude), in PEFT's names
            module, tensor_name = split_adapter_name(name)
            if module == adapted[0]:
                tensors[f"{prefix}.{variant.peft_names.get(tensor_name, tensor_name)}"] = adapters[name]
    return tensors, fused


def _is_expert_adapter(name: str) -> bool:
    return split_adapter_name(name)[0].endswith(tuple(EXPERT_ADAPTERS.values()))


def peft_expert_tensors(adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert adapters (litsft names: A (E, r, in), B (E, out, r)) -> the tensors of PEFT's `target_parameters`
    adapter on transformers' fused experts `model.layers.{i}.mlp.experts` (peft 0.21's ParamWrapper): A (E * r,
    in), row e * r + j = A[e, j]; B (out, r * E), column j * E + e = B[e, :, j] (its `get_delta_factors`).
    With target_parameters [gate_up_proj, down_proj] PEFT wraps gate_up_proj first, so its adapter sits under
    the outer wrapper's `base_layer`."""
    inner = {"gate_up_lora": ".base_layer", "down_lora": ""}
    tensors = {}
    for name, tensor in adapters.items():
        module, tensor_name = split_adapter_name(name)  # blocks.{i}.mlp.experts.gate_up_lora, lora_A.weight
        layer, projection = module.split(".")[1], module.rpartition(".")[2]
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts{inner[projection]}"
        if tensor_name == "lora_A.weight":
            tensors[f"{prefix}.lora_A.weight"] = tensor.reshape(-1, tensor.shape[-1]).contiguous()
        else:
            tensors[f"{prefix}.lora_B.weight"] = (
                tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1).contiguous()
            )
    return tensors


def _module_name(hf_weight: str) -> str:
    """`model.layers.0.self_attn.qkv_proj.weight` -> `qkv_proj`: what PEFT's target_modules match."""
    return hf_weight.removesuffix(".weight").rpartition(".")[2]


def export_peft_adapter(lora_checkpoint_dir: Path, out_dir: Path, base_model_name_or_path: str = "") -> None:
    """Write a LoRA checkpoint as a Hugging Face PEFT adapter (adapter_config.json, adapter_model.safetensors)
    that `peft.AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads with its base model.

    Args:
        lora_checkpoint_dir: A LoRA checkpoint directory written by finetune_lora.
        out_dir: Where to write the adapter; must not exist or be empty.
        base_model_name_or_path: Recorded in adapter_config.json. Default: the Hugging Face model the base
            was converted from (its hub id, or its directory while that exists); else the base is exported
            to Hugging Face format as out_dir/base and that path is recorded.
    """
    folder = read_lora_folder(lora_checkpoint_dir)
    folder.check_base_manifest()
    out_dir = Path(out_dir)
    base_name = base_model_name_or_path or _hf_source_of(folder.base_dir)
    with publish_atomically(out_dir, "the PEFT adapter") as tmp_dir:
        if base_name is None:
            base_name = str(out_dir.resolve() / "base")
            (tmp_dir / "base").mkdir()
            base_config = Config.from_checkpoint(folder.base_dir)
            write_hf_checkpoint(
                iter_model_tensors(folder.base_dir), base_config, tmp_dir / "base", folder.base_dir
            )
        # What the variant's PEFT adapter holds (PiSSA: a plain LoRA of twice the rank on the original base).
        peft_adapters, peft_lora = adapter_variant(folder.config.variant).peft_form(
            folder.adapters, folder.config
        )
        experts = {name: t for name, t in peft_adapters.items() if _is_expert_adapter(name)}
        adapters, fused = peft_adapter_tensors(
            {name: t for name, t in peft_adapters.items() if name not in experts},
            Config.from_checkpoint(folder.base_dir),
            peft_lora,
        )
        modules = sorted({name.split(".")[-3] for name in adapters if name.endswith(".lora_A.weight")})
        adapters.update(peft_expert_tensors(experts))
        save_safetensors(adapters, tmp_dir / PEFT_ADAPTER_NAME)
        peft_config = _peft_config(peft_lora, base_name, modules, fused)
        if experts:
            peft_config["target_parameters"] = [f"mlp.experts.{weight}" for weight in EXPERT_ADAPTERS]
        write_json(tmp_dir / PEFT_CONFIG_NAME, peft_config)
        copy_tokenizer_files(Path(lora_checkpoint_dir), tmp_dir)
    if folder.base_quantization is not None:
        print(quantized_base_notice(lora_checkpoint_dir, out_dir, base_name, folder.base_quantization))


def quantized_base_notice(lora_checkpoint_dir: Path, out_dir: Path, base_name: str, quantization: str) -> str:
    """What a PEFT export of QLoRA adapters is: PEFT names an unquantized base, and the adapters were trained
    on its quantized weights, so the two together are not exactly the trained model; the merged export is."""
    return (
        f"note: {out_dir} names the unquantized base {base_name}, but these adapters were trained on its "
        f"{quantization.upper()} weights: loaded there, the model's logits differ from the trained model's by "
        f"{quantization.upper()}'s rounding. For the trained model exactly, export it merged (the adapters folded "
        f"into the dequantized weights): litsft convert_to_hf {lora_checkpoint_dir} --lora_format merged"
    )


def _peft_config(
    lora_config: LoRAConfig, base_model_name_or_path: str, target_modules: list[str], fused: dict[str, int]
) -> dict[str, object]:
    """PEFT's adapter_config.json; a fused module joining n adapters has n times litsft's rank, and the alpha
    that keeps the variant's scaling (`peft_adapter_tensors`), in PEFT's per-module rank_pattern and alpha_pattern."""
    variant = adapter_variant(lora_config.variant)
    alpha = int(lora_config.alpha) if float(lora_config.alpha).is_integer() else lora_config.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora_config.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": target_modules,
        "rank_pattern": {module: n * lora_config.rank for module, n in fused.items()},
        "alpha_pattern": {module: variant.alpha_for_rank_times(alpha, n) for module, n in fused.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        **variant.peft_config(),
        "modules_to_save": None,
        "inference_mode": True,
    }


def _hf_source_of(model_dir: Path) -> str | None:
    """The Hugging Face model a litsft folder was converted from, if transformers can still load it by that
    name: a hub id, or a local directory that still holds a config.json."""
    source = read_manifest(model_dir).get("hf_source")
    if not isinstance(source, str):
        return None
    if Path(source).is_absolute():
        return source if (Path(source) / "config.json").is_file() else None
    return source


def _hub_id_of_cache_path(hf_dir: Path) -> str | None:
    match = _HUB_CACHE_PATH.search(hf_dir.resolve().as_posix())
    return f"{match['org']}/{match['name']}" if match else None


# ---- checks ----------------------------------------------------------------------------------------------
def _read_hf_config(hf_dir: Path, name: str | None = None) -> Config:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise LitsftError(
            f"{hf_dir} has no config.json; point hf_dir at a Hugging Face checkpoint directory "
            "(the one with config.json and the weights)"
        )
    return Config.from_hf_config(read_json(path), name=name or hf_dir.resolve().name)


def _check_hf_tokenizer(hf_dir: Path, config: Config) -> bool:
    """Whether `hf_dir` has a tokenizer.json; refuses one that does not parse or has more tokens than the
    model has embeddings (generating or training with it would index past the embedding table)."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tokens = read_tokenizer_file(path).get_vocab_size(with_added_tokens=True)
    check_tokenizer_fits(
        tokens, config.vocab_size, path, fix="convert the tokenizer that belongs to these weights"
    )
    return True


def _check_hf_tensors(hf_dir: Path, config: Config) -> dict[str, tuple[str, ...]]:
    """Check the HF checkpoint's tensors against `config`; returns HF name -> the litsft names it holds (one,
    or the parts of a fused tensor), for the tensors to convert (both halves of an MXFP4 tensor)."""
    infos = tensor_infos(hf_dir)
    files = weight_file_map(hf_dir)
    packed = packed_tensors(infos, files)
    for stem, (blocks, scales) in packed.items():  # checked as the dense tensor they dequantize to
        infos[stem] = (dequantized_shape(infos.pop(blocks)[0]), torch.bfloat16)
        files[stem] = files[scales]
        del infos[scales]
    weights = weight_map(config)
    expected = expected_shapes(config)
    names: dict[str, tuple[str, ...]] = {}
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    expert_parts: dict[str, dict[tuple[int, int], tuple[tuple[int, ...], str]]] = {}
    for name in infos:
        expert_part = weights.expert_part(name)
        if expert_part is not None:  # one expert's tensor: checked once every expert of its layer is known
            target, expert, part, _ = expert_part
            names[name] = (target,)
            expert_parts.setdefault(target, {})[expert, part] = (infos[name][0], str(files[name]))
            continue
        targets = weights.litsft_names(name)
        # Tied checkpoints sometimes store lm_head anyway; it is the embedding, so it is dropped.
        if weights.is_ignored(name) or (config.tie_word_embeddings and targets == ("lm_head.weight",)):
            continue
        if targets is None:
            raise LitsftError(
                f"{files[name]}: tensor {name!r} has no counterpart in litsft's {config.hf_architecture}; "
                f"litsft converts only checkpoints of the architectures it supports: {', '.join(FAMILIES)}"
            )
        names[name] = targets
        shape = infos[name][0]
        layout = weights.layout(targets[0])
        if layout is not None:  # the litsft shape of a tensor the hub lays out otherwise
            shape = tuple(layout.to_litsft(torch.empty(shape, device="meta")).shape)
        rows = [expected[target][0] if target in expected else 0 for target in targets]
        if len(targets) > 1 and sum(rows) != shape[0]:
            raise LitsftError(
                f"{files[name]}: fused tensor {name!r} has {shape[0]} rows but the config's {', '.join(targets)} "
                f"need {sum(rows)}; the config does not match the weights, restore the original config"
            )
        for target, size in zip(targets, rows):
            found[target] = ((size, *shape[1:]) if len(targets) > 1 else shape, str(files[name]))
    # The checkpoint's experts per layer: as many as its fullest layer has, so that a layer short of some is
    # named as incomplete, and only a checkpoint short of them in every layer is held against the config.
    experts = max((1 + max(expert for expert, _ in parts) for parts in expert_parts.values()), default=0)
    lacking = sorted(
        name
        for target, parts in expert_parts.items()
        for expert in range(experts)
        for part, name in enumerate(weights.expert_names(target, expert))
        if (expert, part) not in parts
    )
    if lacking:
        more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
        raise LitsftError(
            f"{hf_dir} lacks expert tensors {', '.join(lacking[:3])}{more} (its fullest layer has {experts} "
            "experts); the checkpoint is incomplete, download it again"
        )
    for target, parts in expert_parts.items():
        found[target] = _stacked_shape(target, parts, experts, weights)
    _check_shapes(found, config, str(hf_dir), weights.hf_name)
    for stem, halves in packed.items():
        names.update(dict.fromkeys(halves, names.pop(stem)))
    return names


def _stacked_shape(
    target: str, parts: dict[tuple[int, int], tuple[tuple[int, ...], str]], experts: int, weights: WeightMap
) -> tuple[tuple[int, ...], str]:
    """The (experts, rows, cols) shape the per-expert tensors of `target` (every part of experts 0 to
    experts - 1, checked by the caller) stack to, after checking that they are all of one shape."""
    per_expert = len(weights.expert_names(target, 0))
    (shape, file), *_ = parts.values()
    for expert in range(experts):
        for part in range(per_expert):
            if parts[expert, part][0] != shape:
                raise LitsftError(
                    f"{parts[expert, part][1]}: the experts of {target!r} differ in shape "
                    f"({list(parts[expert, part][0])} vs {list(shape)}); restore the original checkpoint"
                )
    return (experts, per_expert * shape[0], *shape[1:]), file


def _check_checkpoint_tensors(checkpoint_dir: Path, config: Config) -> None:
    infos = model_tensor_shapes(checkpoint_dir)
    files = weight_file_map(checkpoint_dir)
    found = {name: (shape, str(files[name])) for name, (shape, _) in infos.items()}
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    _check_shapes(found, config, str(checkpoint_dir), lambda name: name)


def _check_shapes(
    found: dict[str, tuple[tuple[int, ...], str]],
    config: Config,
    directory: str,
    display_name: Callable[[str], str],
) -> None:
    """Compare found (litsft name -> (shape, file)) with what `config` requires; errors use display_name."""
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in found:
            raise LitsftError(
                f"{directory} lacks tensor {display_name(name)!r} that its config requires; "
                "the checkpoint is incomplete or its config belongs to another model"
            )
        if found[name][0] != shape:
            raise LitsftError(
                f"{found[name][1]}: tensor {display_name(name)!r} has shape {list(found[name][0])} but the "
                f"config requires {list(shape)}; the config does not match the weights, restore the original config"
            )
    for name in sorted(found.keys() - expected.keys()):
        raise LitsftError(
            f"{found[name][1]}: unexpected tensor {display_name(name)!r} that the config does not have; "
            "the config does not match the weights, restore the original config"
        )


def _cast_to(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: DType, stored_dtypes: dict[str, torch.dtype]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`dtype`, or for "auto" each tensor's stored dtype (a dequantized NF4 weight comes as fp32)."""
    if dtype != "auto":
        yield from _cast(named_tensors, dtype)
        return
    for name, tensor in named_tensors:
        stored = stored_dtypes.get(name, stored_dtypes["embed.weight"])  # an untied lm_head: the embedding's
        yield name, tensor.to(stored)


def _cast(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: DType
) -> Iterator[tuple[str, torch.Tensor]]:
    if dtype == "auto":
        yield from named_tensors
        return
    torch_dtype = getattr(torch, dtype)
    for name, tensor in named_tensors:
        yield name, tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
