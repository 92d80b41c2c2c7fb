"""Every YAML in config_hub/ parses against its recipe (the directory it is in) and says what its name promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace
from litsft.recipes import finetune_full, finetune_lora, pretrain

from litsft.data import JSON, HFDataset, LitData, TextFiles
from litsft.model.config import NAMED_CONFIGS
from litsft.training.args import step_geometry
from litsft.training.layout import ParallelLayout

CONFIG_HUB = Path(__file__).parent.parent / "config_hub"
RECIPES = {
    "finetune_full": finetune_full.setup,
    "finetune_lora": finetune_lora.setup,
    "pretrain": pretrain.setup,
}

ONE_DEVICE_FULL = {"devices": 1, "precision": "bf16-mixed", "resume": "auto", "train.epochs": 3}
# Values each config must hold (dotted keys into the parsed config); the numbers come from the recipes they
# reproduce (docs: tutorials/finetune_full.md, finetune_lora.md, pretrain.md).
EXPECTED: dict[str, dict[str, Any]] = {
    "finetune_full/llama-2-7b-vicuna.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-2-7b-hf",
        "fsdp.sharding_strategy": "FULL_SHARD",
        "precision": "bf16-mixed",
        "optimizer.lr": 2e-5,
        "optimizer.schedule": "cosine",
        "optimizer.warmup_fraction": 0.03,
        "optimizer.warmup_steps": None,
        "train.epochs": 3,
        "train.max_steps": None,
        "train.global_batch_size": 128,
        "train.max_seq_length": 2048,
        "data": JSON,
        "data.json_path": Path("data/conversations.jsonl"),
        "resume": "auto",
    },
    "finetune_full/qwen2.5-1.5b-instruct-dpo.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen2.5-1.5B-Instruct",
        "objective.name": "dpo",
        "objective.beta": 0.01,
        "optimizer.lr": 5e-7,
        "devices": 8,
        "train.global_batch_size": 128,
        "train.micro_batch_size": 8,
        "data": HFDataset,
        "data.path": "HuggingFaceH4/ultrafeedback_binarized",
        "data.split": "train_prefs",
        "data.packing": False,
    },
    "finetune_full/qwen2.5-3b-instruct.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen2.5-3B",
        "optimizer.lr": 1e-5,
        "optimizer.schedule": "cosine",
        "optimizer.min_lr": 0.0,
        "optimizer.warmup_steps": 40,
        "optimizer.weight_decay": 0.0,
        "optimizer.betas": (0.9, 0.95),
        "train.max_norm": 1.0,
        "train.micro_batch_size": 11,
        "devices": 8,
        "num_nodes": 1,
        "train.global_batch_size": 528,
        "fsdp.activation_checkpointing": True,
        "data": HFDataset,
        "data.path": "BAAI/Infinity-Instruct",
        "data.name": "0625",
        "data.packing": True,
        "fsdp.sharding_strategy": "SHARD_GRAD_OP",
        "train.epochs": 3,
        "train.max_steps": None,
    },
    "finetune_full/llama-3.2-1b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-3.2-1B",
        **ONE_DEVICE_FULL,
    },
    "finetune_full/llama-3.2-3b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-3.2-3B",
        **ONE_DEVICE_FULL,
    },
    "finetune_full/qwen3-0.6b.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen3-0.6B",
        **ONE_DEVICE_FULL,
    },
    "finetune_full/qwen3-1.7b.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen3-1.7B",
        **ONE_DEVICE_FULL,
    },
    "finetune_full/smollm2-1.7b.yaml": {
        "checkpoint_dir": "checkpoints/HuggingFaceTB/SmolLM2-1.7B",
        **ONE_DEVICE_FULL,
    },
    "finetune_full/llama-3.1-8b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-3.1-8B",
        "devices": 8,
        "num_nodes": 1,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "precision": "bf16-mixed",
    },
    # Long context: 64k-token packed rows, each split over 2 GPUs (the context size litsft plan fits).
    "finetune_full/llama-3.1-8b-64k-reasoning.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-3.1-8B",
        "devices": 8,
        "num_nodes": 1,
        "parallel.context": 2,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "fsdp.activation_checkpointing": True,
        "train.max_seq_length": 65536,
        "train.micro_batch_size": 1,
        "data": HFDataset,
        "data.path": "open-r1/Mixture-of-Thoughts",
        "data.packing": True,
    },
    "finetune_full/phi-4-mini-instruct.yaml": {
        "checkpoint_dir": "checkpoints/microsoft/Phi-4-mini-instruct",
        "devices": 2,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "fsdp.activation_checkpointing": True,
        "precision": "bf16-mixed",
        "train.epochs": 3,
        "train.global_batch_size": 32,
        "data": JSON,
    },
    # Mixtures of experts: 8 GPUs, the families' own load-balancing coefficients (none is overridden).
    "finetune_full/olmoe-1b-7b.yaml": {
        "checkpoint_dir": "checkpoints/allenai/OLMoE-1B-7B-0924",
        "devices": 8,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "train.router_aux_loss_coef": None,
        "data": JSON,
    },
    "finetune_full/qwen3-30b-a3b.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen3-30B-A3B",
        "devices": 8,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "fsdp.activation_checkpointing": True,
        "train.router_aux_loss_coef": None,
        "data": JSON,
    },
    # Expert parallelism: 16 of the 128 experts a GPU, room for micro-batches of 2 (litsft plan).
    "finetune_full/qwen3-30b-a3b-expert-parallel.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen3-30B-A3B",
        "devices": 8,
        "parallel.expert": 8,
        "fsdp.sharding_strategy": "FULL_SHARD",
        "fsdp.activation_checkpointing": True,
        "train.micro_batch_size": 2,
        "train.router_aux_loss_coef": None,
        "data": JSON,
    },
    "finetune_lora/qwen3-30b-a3b.yaml": {
        "checkpoint_dir": "checkpoints/Qwen/Qwen3-30B-A3B",
        "devices": 8,
        "lora.targets": "all-linear",
        "train.router_aux_loss_coef": None,
        "data": JSON,
    },
    "finetune_lora/mixtral-8x7b.yaml": {
        "checkpoint_dir": "checkpoints/mistralai/Mixtral-8x7B-v0.1",
        "devices": 8,
        "lora.targets": "all-linear",
        "train.router_aux_loss_coef": None,
        "data": JSON,
    },
    "finetune_lora/llama-2-7b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-2-7b-hf",
        "devices": 4,
        "data": JSON,
        "data.json_path": Path("data/alpaca.json"),
    },
    "finetune_lora/llama-3.1-8b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-3.1-8B",
        "devices": 4,
        "data": JSON,
        "data.json_path": Path("data/alpaca.json"),
    },
    "finetune_lora/gemma-3-4b-it.yaml": {
        "checkpoint_dir": "checkpoints/google/gemma-3-4b-it",
        "devices": 1,
        "lora.rank": 16,
        "lora.targets": "all-linear",
        "data": JSON,
        "data.json_path": Path("data/alpaca.json"),
    },
    "finetune_lora/llama-2-70b.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-2-70b-hf",
        "devices": 8,
        "data": JSON,
        "data.json_path": Path("data/alpaca.json"),
    },
    "finetune_lora/llama-2-70b-qlora.yaml": {
        "checkpoint_dir": "checkpoints/meta-llama/Llama-2-70b-hf",
        "devices": 2,
        "quantize": "nf4",
        "lora.rank": 16,
    },
    "pretrain/debug.yaml": {
        "model_name": "demo-llama",
        "devices": 1,
        "data": TextFiles,
        "train.max_steps": 20,
        "train.max_seq_length": 128,
    },
    "pretrain/tinyllama-1.1b.yaml": {
        "model_name": "TinyLlama-1.1B",
        "devices": 8,
        "num_nodes": 2,
        "fsdp.sharding_strategy": "HYBRID_SHARD",
        "data": LitData,
        "train.global_batch_size": 1024,
        "train.max_seq_length": 2048,
    },
}


def parse(path: Path) -> Namespace:
    """The YAML parsed and its classes instantiated by the recipe's own CLI parser, without running it."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(RECIPES[path.parent.name], as_positional=True)
    return parser.instantiate(parser.parse_args(["--config", str(path)]))


def lookup(config: Namespace, dotted: str) -> Any:
    value: Any = config
    for key in dotted.split("."):
        value = getattr(value, key)
    return value


def test_every_yaml_has_expectations() -> None:
    found = {str(p.relative_to(CONFIG_HUB)) for p in CONFIG_HUB.rglob("*.yaml")}
    assert found == set(EXPECTED)
    assert {Path(name).parent.name for name in found} <= set(RECIPES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_with_its_values(name: str) -> None:
    config = parse(CONFIG_HUB / name)
    for key, expected in EXPECTED[name].items():
        value = lookup(config, key)
        if isinstance(expected, type):
            assert isinstance(value, expected), (key, value)
        else:
            assert value == expected, (key, value)
    # The layout and the batch arithmetic hold (the engine refuses the run otherwise: the ranks of a context
    # group read the same micro-batch) and the model is a known one.
    context = config.parallel.context if "parallel" in config else 1
    expert = config.parallel.expert if "parallel" in config else 1
    layout = ParallelLayout.of(
        config.devices, config.num_nodes, config.fsdp.sharding_strategy, context, expert
    )
    accumulation = step_geometry(config.train, layout.data_replicas).accumulation_steps
    assert (
        accumulation * config.train.micro_batch_size * layout.data_replicas == config.train.global_batch_size
    )
    model = config.model_name if name.startswith("pretrain/") else Path(config.checkpoint_dir).name
    assert model in NAMED_CONFIGS
    layout.check_heads(NAMED_CONFIGS[model].num_heads, model)
    layout.check_experts(NAMED_CONFIGS[model].num_experts, model)
    if config.train.max_seq_length is not None:
        assert config.train.max_seq_length <= NAMED_CONFIGS[model].max_position_embeddings
    if name.startswith("finetune"):
        # The conventional location of `litsft convert_from_hf <hf dir> --out_dir checkpoints/<org>/<name>`.
        parts = Path(config.checkpoint_dir).parts
        assert parts[0] == "checkpoints" and len(parts) == 3


def test_an_unknown_key_is_rejected(tmp_path: Path) -> None:
    """What keeps the hub from rotting: a renamed option fails the parse instead of being ignored."""
    (tmp_path / "finetune_full").mkdir()
    path = tmp_path / "finetune_full" / "bad.yaml"
    path.write_text("checkpoint_dir: checkpoints/x/y\ntrain:\n  global_batch: 8\n")
    with pytest.raises(ArgumentError, match="global_batch"):
        parse(path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_key_of_a_shipped_config_is_called_unknown(name: str) -> None:
    """The CLI's diagnosis of a failed parse (litsft/cli/cli_errors.py) knows every key the hub uses, so it
    never blames a valid key for another problem."""
    from litsft.cli.cli_errors import explain_parse_error

    def make_parser() -> ArgumentParser:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_argument("--config", action=ActionConfigFile)
        parser.add_function_arguments(RECIPES[name.split("/")[0]], as_positional=True)
        return parser

    assert explain_parse_error(make_parser, ["--config", str(CONFIG_HUB / name)]) is None
