"""The LoRA folder that finetune_lora writes (its final/ directory), and reading it back:

    lora_config.json      LoRAConfig, plus "base_checkpoint" (the litsft model folder the adapters were trained
                          on), "base_weights_sha256" (that folder's weights fingerprint at the time) and, for
                          QLoRA, "base_quantization" ("nf4": the base's adapted projections were 4-bit)
    adapter.safetensors   adapter tensors in litsft names (`blocks.0.attn.q_proj.lora_A.weight`), with the
                          variant's own (DoRA's magnitudes; PiSSA's initial A and B, from which its residual
                          base is rebuilt: litsft.model.lora.variants)
    tokenizer files       copied from the base model folder

Whatever uses the adapters with base weights (merging, exporting, generating) checks the base's
fingerprint first: adapters applied to weights other than those they were trained on give a wrong model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import get_args

import torch

from litsft.checkpoint.model_folder import copy_tokenizer_files, read_manifest, weights_fingerprint
from litsft.checkpoint.weight_files import load_safetensors, save_safetensors
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig, Quantization
from litsft.model.lora.layers import check_adapter_shapes
from litsft.runtime.files import read_json, write_json

LORA_CONFIG_NAME = "lora_config.json"
ADAPTER_NAME = "adapter.safetensors"


@dataclass
class LoRAFolder:
    """A LoRA folder read back: its adapters, their config, and the base model folder they belong to."""

    path: Path
    config: LoRAConfig
    base_dir: Path
    adapters: dict[str, torch.Tensor]
    base_fingerprint: str | None
    """The base's weights fingerprint when the adapters were saved; None in folders older than the record."""
    base_quantization: Quantization | None = None
    """How the base's adapted projections were stored in training (nf4: QLoRA); None for as stored."""

    def check_base(self, fingerprint: str) -> None:
        """Refuse base weights whose fingerprint differs from the one the adapters were trained on."""
        if self.base_fingerprint is not None and fingerprint != self.base_fingerprint:
            raise LitsftError(
                f"the weights in {self.base_dir} changed since the adapters in {self.path} were trained on them "
                f"(fingerprint {fingerprint[:12]}, recorded {self.base_fingerprint[:12]}); restore the base "
                "checkpoint they were trained on, or point base_checkpoint in "
                f"{self.path / LORA_CONFIG_NAME} at a copy of it"
            )

    def check_base_manifest(self) -> None:
        """`check_base` against the fingerprint the base's manifest records: cheap, no weights read."""
        recorded = read_manifest(self.base_dir).get("weights_sha256")
        if isinstance(recorded, str):
            self.check_base(recorded)


def is_lora_folder(directory: Path) -> bool:
    return (Path(directory) / LORA_CONFIG_NAME).is_file()


def save_lora_folder(
    adapter_state_dict: Mapping[str, torch.Tensor],
    lora_config: LoRAConfig,
    base_dir: Path,
    out_dir: Path,
    base_quantization: Quantization | None = None,
) -> None:
    """Write a LoRA folder (see the module docstring). The adapters are checked against the base model's
    shapes first, so a mismatch writes nothing. Files already in `out_dir` are replaced."""
    base_dir = Path(base_dir).resolve()
    config = Config.from_checkpoint(base_dir)
    adapters = {name: tensor.detach().to("cpu").contiguous() for name, tensor in adapter_state_dict.items()}
    check_adapter_shapes(adapters, config, lora_config, source="adapter state dict")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(adapters, out_dir / ADAPTER_NAME)
    copy_tokenizer_files(base_dir, out_dir)
    # Config last: a directory with lora_config.json is a finished LoRA folder.
    values = {
        # Unset options (a variant's own, such as loraplus_lr_ratio, under another variant) are left out.
        **{key: value for key, value in asdict(lora_config).items() if value is not None},
        "base_checkpoint": str(base_dir),
        "base_weights_sha256": weights_fingerprint(base_dir),
    }
    if base_quantization is not None:
        values["base_quantization"] = base_quantization
    write_json(out_dir / LORA_CONFIG_NAME, values)


def read_lora_folder(directory: Path) -> LoRAFolder:
    """A LoRA folder's adapters, config and base, with the adapters checked against the base's shapes."""
    directory = Path(directory)
    config_path = directory / LORA_CONFIG_NAME
    if not config_path.is_file():
        raise LitsftError(
            f"{directory} is not a LoRA checkpoint: {LORA_CONFIG_NAME} is missing. "
            "Pass the directory that finetune_lora wrote (e.g. <out_dir>/final)"
        )
    values = read_json(config_path, fix="restore it from the run")
    try:
        base_dir = Path(values.pop("base_checkpoint"))
        base_fingerprint = values.pop("base_weights_sha256", None)
        base_quantization = values.pop("base_quantization", None)
        if base_quantization not in (None, *get_args(Quantization)):
            raise LitsftError(
                f"{config_path}: base_quantization {base_quantization!r} is not one of {get_args(Quantization)}"
            )
        unknown = sorted(set(values) - {f.name for f in fields(LoRAConfig)})
        if unknown:
            raise LitsftError(
                f"{config_path} has unknown keys {unknown}; it was written by a different litsft version"
            )
        lora_config = LoRAConfig(**values)
    except (KeyError, TypeError, AttributeError) as err:
        raise LitsftError(
            f"{config_path} is not a valid LoRA config ({err!r}); restore it from the run"
        ) from None
    if not base_dir.is_absolute():
        base_dir = directory / base_dir
    if not base_dir.is_dir():
        raise LitsftError(
            f"base checkpoint {base_dir} named in {config_path} does not exist; "
            "restore it there or edit base_checkpoint in that file"
        )
    config = Config.from_checkpoint(base_dir)
    adapter_path = directory / ADAPTER_NAME
    if not adapter_path.is_file():
        raise LitsftError(f"{directory} has no {ADAPTER_NAME}; the LoRA checkpoint is incomplete")
    adapters = load_safetensors(adapter_path, fix="the adapters are damaged; restore the file from a copy")
    check_adapter_shapes(adapters, config, lora_config, source=str(adapter_path))
    return LoRAFolder(directory, lora_config, base_dir, adapters, base_fingerprint, base_quantization)
