"""litsft/checkpoint/lora_folder.py: the folder finetune_lora writes, read back as written, and refused when its
adapters do not fit the base or are damaged, its base changed or is gone, or its config is not one litsft wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import write_tiny_checkpoint

from litsft.checkpoint.lora_folder import (
    ADAPTER_NAME,
    LORA_CONFIG_NAME,
    is_lora_folder,
    read_lora_folder,
    save_lora_folder,
)
from litsft.checkpoint.model_folder import weights_fingerprint
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import apply_lora, lora_state_dict
from litsft.model.network.transformer import Transformer

LORA = LoRAConfig(rank=2, alpha=4, targets=["q", "v"])


def adapters(seed: int = 0, lora: LoRAConfig = LORA) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = apply_lora(Transformer(Config.from_name("tiny-llama")), lora)
    for name, param in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param)  # lora_B starts at zero: give it values to compare
    return {name: tensor.clone() for name, tensor in lora_state_dict(model).items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lora_folder") / "base")


def test_a_lora_folder_reads_back_as_written(base: Path, tmp_path: Path) -> None:
    written = adapters()
    save_lora_folder(written, LORA, base, tmp_path / "final")
    assert is_lora_folder(tmp_path / "final") and not is_lora_folder(base)
    assert {"tokenizer.json", ADAPTER_NAME, LORA_CONFIG_NAME} <= {
        p.name for p in (tmp_path / "final").iterdir()
    }
    folder = read_lora_folder(tmp_path / "final")
    assert folder.config == LORA and folder.base_dir == base.resolve()
    assert folder.adapters.keys() == written.keys()
    assert all(torch.equal(folder.adapters[name], tensor) for name, tensor in written.items())
    assert folder.base_fingerprint == weights_fingerprint(base)
    folder.check_base(weights_fingerprint(base))
    folder.check_base_manifest()
    with pytest.raises(LitsftError, match="changed since the adapters .* were trained on them"):
        folder.check_base("0" * 64)


def test_adapters_that_do_not_fit_the_base_write_nothing(base: Path, tmp_path: Path) -> None:
    with pytest.raises(LitsftError, match="has shape .* needs"):
        save_lora_folder(
            adapters(lora=LoRAConfig(rank=4, targets=["q", "v"])), LORA, base, tmp_path / "final"
        )
    with pytest.raises(LitsftError, match="adapter tensors are missing"):
        save_lora_folder(dict(list(adapters().items())[:-1]), LORA, base, tmp_path / "final")
    assert not (tmp_path / "final").exists()


def rewrite_config(folder: Path, **changes: object) -> None:
    path = folder / LORA_CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(rank_typo=8), r"has unknown keys \['rank_typo'\]"),
        (dict(base_checkpoint="/no/such/base"), "base checkpoint /no/such/base named in .* does not exist"),
        (dict(rank=4), r"has shape .* but .* with rank 4 needs"),
    ],
)
def test_a_folder_whose_config_does_not_fit_is_refused(
    base: Path, tmp_path: Path, changes: dict, message: str
) -> None:
    save_lora_folder(adapters(), LORA, base, tmp_path / "final")
    rewrite_config(tmp_path / "final", **changes)
    with pytest.raises(LitsftError, match=message):
        read_lora_folder(tmp_path / "final")


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_damaged_adapters_are_refused_in_one_line(base: Path, tmp_path: Path, damage: str) -> None:
    """What convert_to_hf and generate read: a traceback from safetensors before."""
    save_lora_folder(adapters(), LORA, base, tmp_path / "final")
    path = tmp_path / "final" / ADAPTER_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * len(data))
    with pytest.raises(LitsftError) as refused:
        read_lora_folder(tmp_path / "final")
    message = str(refused.value)
    assert message.startswith(f"{path} is not a valid safetensors file (") and "\n" not in message
    assert message.endswith("); the adapters are damaged; restore the file from a copy")


def test_a_directory_that_is_no_lora_folder_is_refused(base: Path) -> None:
    with pytest.raises(LitsftError, match=f"is not a LoRA checkpoint: {LORA_CONFIG_NAME} is missing"):
        read_lora_folder(base)
