"""A litsft model folder as a `Transformer` to run: a checkpoint's weights, or a finetune_lora final/ as its
base with the adapters applied (not merged), after checking that the base is the one they were trained on.
What generation, evaluation and the export check load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from litsft.checkpoint.lora_folder import is_lora_folder, read_lora_folder
from litsft.checkpoint.model_folder import fingerprint_of_state_dict, load_model_state_dict
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.layers import apply_lora, base_weight_name, load_adapters
from litsft.model.network.transformer import Transformer
from litsft.model.precision.quantization import is_quantized_weight, nf4_round_trip


def load_model(checkpoint_dir: Path, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A litsft checkpoint's model, on `device` in `dtype`, in eval mode. A LoRA folder gives its base model
    with the adapters applied (not merged), after checking that the base is the one they were trained on."""
    if is_lora_folder(checkpoint_dir):
        folder = read_lora_folder(checkpoint_dir)
        model = _load_full_model(folder.base_dir, check_base=folder.check_base)
        apply_lora(model, folder.config, initialize=False)
        load_adapters(model, folder.adapters)
        with torch.no_grad():
            if folder.base_quantization == "nf4":  # the adapters were trained on the dequantized NF4 weights
                for name, param in model.named_parameters():
                    stored = base_weight_name(name)
                    if stored is not None and is_quantized_weight(stored, folder.adapters):
                        param.copy_(nf4_round_trip(param))
    else:
        model = _load_full_model(checkpoint_dir)
    return model.to(device=device, dtype=dtype).eval()


def _load_full_model(checkpoint_dir: Path, check_base: Callable[[str], None] | None = None) -> Transformer:
    config = Config.from_checkpoint(checkpoint_dir)
    state_dict = load_model_state_dict(checkpoint_dir)
    if check_base is not None:
        check_base(fingerprint_of_state_dict(state_dict, config))
    with torch.device("meta"):
        model = Transformer(config)
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as err:
        first_line = str(err).strip().splitlines()[0]
        raise LitsftError(
            f"the weights in {checkpoint_dir} do not fit its {checkpoint_dir / 'litsft_config.json'}: "
            f"{first_line}; convert the checkpoint again"
        ) from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # assign=True replaced the shared parameter
    return model
