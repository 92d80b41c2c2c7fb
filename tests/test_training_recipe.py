"""litsft/training/recipe.py: what a recipe tells the engine, its defaults, the values the three shipped recipes give,
each recipe's model trainable where its `trainable` says, and the module imported without torch (recipe
modules import it to declare their command line)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import write_tiny_checkpoint
from litsft.recipes.finetune_full import full_finetuning
from litsft.recipes.finetune_lora import lora_finetuning
from litsft.recipes.pretrain import pretraining

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.model.config import Config
from litsft.model.lora_config import LoRAConfig
from litsft.training.recipe import Recipe


def test_fields_and_defaults() -> None:
    def nothing(*args: object) -> None:
        return None

    recipe = Recipe("mine", build_model=nothing, initialize=nothing, save_final=nothing)
    assert [field.name for field in dataclasses.fields(Recipe)] == [
        "name",
        "build_model",
        "initialize",
        "save_final",
        "checkpoint_frozen",
        "trainable",
    ]
    assert (recipe.checkpoint_frozen, recipe.trainable) == (True, "all")


def test_importing_it_imports_neither_torch_nor_lightning() -> None:
    probe = "import sys, litsft.training.recipe; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning')))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout == "[]\n", result.stderr


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"))


def built(recipe: Recipe, config: Config) -> torch.nn.Module:
    model = recipe.build_model(config)
    recipe.initialize(model)
    return model


def test_full_finetuning_trains_every_weight_from_the_checkpoints(checkpoint_dir: Path) -> None:
    config = Config.from_checkpoint(checkpoint_dir)
    recipe = full_finetuning(checkpoint_dir, config)
    assert (recipe.name, recipe.trainable, recipe.checkpoint_frozen) == ("finetune_full", "all", True)
    model = built(recipe, config)
    assert all(param.requires_grad for param in model.parameters())
    stored = load_model_state_dict(checkpoint_dir)
    assert all(torch.equal(param, stored[name]) for name, param in model.state_dict().items())


def test_pretraining_draws_the_same_fresh_weights_for_the_same_seed(checkpoint_dir: Path) -> None:
    config = Config.from_checkpoint(checkpoint_dir)
    recipe = pretraining(config, checkpoint_dir, seed=3)
    assert (recipe.name, recipe.trainable, recipe.checkpoint_frozen) == ("pretrain", "all", True)
    first, again = built(recipe, config), built(pretraining(config, checkpoint_dir, seed=3), config)
    other = built(pretraining(config, checkpoint_dir, seed=4), config)
    assert all(param.requires_grad for param in first.parameters())
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    assert not torch.equal(first.embed.weight, other.embed.weight)


def test_lora_finetuning_trains_only_the_adapters_and_checkpoints_only_them(checkpoint_dir: Path) -> None:
    config = Config.from_checkpoint(checkpoint_dir)
    recipe = lora_finetuning(checkpoint_dir, LoRAConfig(rank=2, targets=["q", "v"]), None, seed=0, run=None)
    assert (recipe.name, recipe.trainable, recipe.checkpoint_frozen) == ("finetune_lora", "lora", False)
    model = built(recipe, config)
    trained = sorted({name.split(".")[-2] for name, p in model.named_parameters() if p.requires_grad})
    assert trained == ["lora_A", "lora_B"]
    assert sum(p.requires_grad for p in model.parameters()) == 2 * 2 * config.num_layers  # A, B on q and v
