"""litsft/checkpoint/model_loader.py: a checkpoint folder loaded as the model that was saved, and a LoRA folder as
its base with the adapters applied, whose outputs are the adapted model's."""

from __future__ import annotations

from pathlib import Path

import torch
from launch import write_tiny_checkpoint

from litsft.checkpoint.lora_folder import save_lora_folder
from litsft.checkpoint.model_folder import load_model_state_dict
from litsft.checkpoint.model_loader import load_model
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import apply_lora, lora_state_dict
from litsft.model.network.transformer import Transformer

TOKENS = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))


def test_a_checkpoint_loads_as_the_model_it_holds_in_eval_mode(tmp_path: Path) -> None:
    base = write_tiny_checkpoint(tmp_path / "base", seed=3)
    model = load_model(base, torch.device("cpu"), torch.float64)
    assert not model.training and next(model.parameters()).dtype == torch.float64
    reference = Transformer(Config.from_checkpoint(base))
    reference.load_state_dict(load_model_state_dict(base))
    with torch.no_grad():
        assert torch.allclose(model(TOKENS), reference.double().eval()(TOKENS), atol=1e-12)


def test_a_lora_folder_loads_as_its_base_with_the_adapters_applied(tmp_path: Path) -> None:
    base = write_tiny_checkpoint(tmp_path / "base", seed=3)
    lora = LoRAConfig(rank=2, alpha=4, targets=["q", "v"])
    adapted = apply_lora(load_model(base, torch.device("cpu"), torch.float32), lora)
    torch.manual_seed(1)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)  # B starts at zero: give the adapters an effect
    save_lora_folder(lora_state_dict(adapted), lora, base, tmp_path / "final")
    loaded = load_model(tmp_path / "final", torch.device("cpu"), torch.float32)
    with torch.no_grad():
        logits = loaded(TOKENS)
        assert (logits - adapted.eval()(TOKENS)).abs().max() < 1e-6
        assert (logits - load_model(base, torch.device("cpu"), torch.float32)(TOKENS)).abs().max() > 1e-3
