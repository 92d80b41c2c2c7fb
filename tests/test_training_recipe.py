"""litsft/training/recipe.py: what a run does with what a recipe tells the engine (built on the meta device, filled,
saved, checkpointed with or without its frozen weights, its FLOPs counted as it trains), the values the three
shipped recipes give, each recipe's model trainable where its `trainable` says, and the module imported without
torch (recipe modules import it to declare their command line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crash_harness import train_args
from launch import litsft_in_process, write_records, write_tiny_checkpoint
from litsft.recipes.finetune_full import full_finetuning
from litsft.recipes.finetune_lora import lora_finetuning
from litsft.recipes.pretrain import pretraining

from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.checkpoint.training_checkpoint import stored_tensors
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig
from litsft.training.recipe import Recipe


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


def recorded_recipe(checkpoint_dir: Path, config: Config, calls: list, **options: object) -> Recipe:
    """finetune_full's recipe given as only its name and three callables (plus `options`), its embedding
    frozen, each call recorded with the device its model's parameters were on."""
    real = full_finetuning(checkpoint_dir, config)

    def build_model(config: Config) -> torch.nn.Module:
        model = real.build_model(config)
        calls.append(("build_model", model.embed.weight.device.type))
        model.embed.weight.requires_grad_(False)
        return model

    def initialize(model: torch.nn.Module) -> None:
        calls.append(("initialize", model.embed.weight.device.type))
        real.initialize(model)

    def save_final(model: torch.nn.Module, final_dir: Path) -> None:
        calls.append(("save_final", final_dir.name))
        real.save_final(model, final_dir)

    return Recipe("finetune_full", build_model, initialize, save_final, **options)


@pytest.mark.parametrize("checkpoint_frozen", [None, False])
def test_a_run_builds_fills_saves_and_checkpoints_as_its_recipe_says(
    checkpoint_dir: Path, tmp_path: Path, capsys, monkeypatch, checkpoint_frozen: bool | None
) -> None:
    """A one-process run of a recipe given only its callables: its model is built once on the meta device,
    filled once materialized, saved once by its save_final into a staging directory published as final/, and
    it counts the FLOPs of training every weight. Its step checkpoints hold every parameter, the frozen
    embedding included, unless it says checkpoint_frozen=False (LoRA's frozen base is loaded again instead)."""
    import litsft.recipes.finetune_full as finetune_full_module

    from litsft.training.metrics import MetricsLogger

    calls: list = []
    options = {} if checkpoint_frozen is None else {"checkpoint_frozen": checkpoint_frozen}
    monkeypatch.setattr(
        finetune_full_module,
        "full_finetuning",
        lambda checkpoint_dir, config: recorded_recipe(checkpoint_dir, config, calls, **options),
    )
    set_model = MetricsLogger.set_model

    def record_trainable(self, *args, trainable="all", **kwargs):
        calls.append(("trainable", trainable))
        return set_model(self, *args, trainable=trainable, **kwargs)

    monkeypatch.setattr(MetricsLogger, "set_model", record_trainable)
    out_dir = tmp_path / "out"
    args = train_args(checkpoint_dir, write_records(tmp_path / "data.json"), out_dir, "--devices", "1",
                      "--train.max_steps", "2")  # fmt: skip
    litsft_in_process(args, tmp_path, capsys)

    assert calls[:3] == [("build_model", "meta"), ("initialize", "cpu"), ("trainable", "all")]
    (saved_by, staging_name), *after = calls[3:]
    assert (saved_by, after) == ("save_final", [])
    assert staging_name != "final" and (out_dir / "final").is_dir()  # written aside, then published
    saved = {
        name.removeprefix("model/")
        for name in stored_tensors(out_dir / "step-00000002").stored()
        if name.startswith("model/")
    }
    stored = set(load_model_state_dict(checkpoint_dir))
    if checkpoint_frozen is False:
        assert saved == stored - {"embed.weight"}
    else:
        assert saved == stored


def test_lora_finetuning_trains_only_the_adapters_and_checkpoints_only_them(checkpoint_dir: Path) -> None:
    config = Config.from_checkpoint(checkpoint_dir)
    recipe = lora_finetuning(checkpoint_dir, LoRAConfig(rank=2, targets=["q", "v"]), None, seed=0, run=None)
    assert (recipe.name, recipe.trainable, recipe.checkpoint_frozen) == ("finetune_lora", "lora", False)
    model = built(recipe, config)
    trained = sorted({name.split(".")[-2] for name, p in model.named_parameters() if p.requires_grad})
    assert trained == ["lora_A", "lora_B"]
    assert sum(p.requires_grad for p in model.parameters()) == 2 * 2 * config.num_layers  # A, B on q and v
    assert recipe.lr_scale("blocks.0.attn.q_proj.lora_B.weight") == 1.0


def test_lora_plus_asks_the_engine_for_b_s_learning_rate_ratio(checkpoint_dir: Path) -> None:
    for ratio, expected in ((None, 16.0), (4.0, 4.0)):
        lora = LoRAConfig(rank=2, targets=["q", "v"], variant="loraplus", loraplus_lr_ratio=ratio)
        recipe = lora_finetuning(checkpoint_dir, lora, None, seed=0, run=None)
        assert recipe.lr_scale("blocks.0.attn.q_proj.lora_B.weight") == expected
        assert recipe.lr_scale("blocks.0.attn.q_proj.lora_A.weight") == 1.0
