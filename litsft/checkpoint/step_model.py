"""A step checkpoint opened as a model: the folder its run would have written to final/ had it ended at that
step, written from the checkpoint's stored weights and trainer_state.json alone (no step is trained, no rank
file is read).

    finetune_full, pretrain   a litsft model folder: every stored `model/<name>` tensor cast to the config's
                              dtype (the step holds the trained parameters in the dtype training kept them in,
                              fp32 under mixed precision; final/ casts them the same way), the run's config and
                              its tokenizer files (and, as for LoRA, the run's validation prompts it recorded)
    finetune_lora             a LoRA folder: the stored adapters over the base the run recorded, refused when
                              that base's weights are no longer those the adapters were trained on

The checkpoint's tensors are DCP's per-rank parts, which litsft's model-folder readers do not read; this
module merges them into whole tensors, one at a time. `litsft.huggingface.model_source` decides where the
result is cached and calls `write_step_model` once per checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from litsft.checkpoint.checkpoint_dirs import (
    FROZEN_BASE,
    FROZEN_FINGERPRINT,
    TOKENIZER_DIR,
    TRAINER_STATE,
    VALIDATION_PROMPTS,
    step_model_state,
)
from litsft.checkpoint.lora_folder import save_lora_folder
from litsft.checkpoint.model_folder import (
    save_model_folder,
    weights_fingerprint,
    write_validation_prompts,
)
from litsft.checkpoint.sharded_tensors import ShardedReader, persistent_buffers
from litsft.checkpoint.training_checkpoint import SHARDS_DIR
from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig
from litsft.model.lora.layers import apply_lora, lora_state_dict
from litsft.model.network.transformer import Transformer

MODEL_PREFIX = "model/"
"""Where a step checkpoint stores the model's parameters (`training_checkpoint.checkpoint_tensors`)."""


def write_step_model(step_dir: Path, out_dir: Path) -> None:
    """Write into the existing, empty `out_dir` what the run of `step_dir` would have written to final/ had
    it ended at that step (see the module docstring). Every file is checked against its checksum first: the
    model written here is cached and reused, so damage inside a weight must be caught now."""
    state = step_model_state(step_dir, contents=True)
    config = Config.from_values(state["config"], step_dir / TRAINER_STATE)
    reader = ShardedReader(
        step_dir / SHARDS_DIR, fix="pass another step checkpoint of that run, or its final/"
    )
    stored = {
        name.removeprefix(MODEL_PREFIX): info
        for name, info in reader.stored().items()
        if name.startswith(MODEL_PREFIX)
    }
    if state["recipe"] == "finetune_lora":
        _write_lora_folder(step_dir, state, config, reader, stored, out_dir)
    else:
        _write_model_folder(step_dir, state, config, reader, stored, out_dir)
    write_validation_prompts(out_dir, state.get(VALIDATION_PROMPTS) or [])


def _write_model_folder(
    step_dir: Path,
    state: dict[str, Any],
    config: Config,
    reader: ShardedReader,
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    out_dir: Path,
) -> None:
    # The model's own order of tensors, as final/ is written in: it decides which tensors share a file.
    with torch.device("meta"):
        model = Transformer(config)
        names = [
            name
            for name in model.state_dict()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        ]
        buffers = persistent_buffers(model)  # kept in their own dtype, as final/ keeps them
    _check_holds(step_dir, stored, names)
    dtype = getattr(torch, config.torch_dtype)

    def tensors() -> Any:
        for name in names:  # one whole tensor in memory at a time
            tensor = _read(reader, name, stored[name])
            yield name, tensor.to(dtype) if tensor.is_floating_point() and name not in buffers else tensor

    tokenizer_dir = _recorded_dir(
        step_dir,
        state,
        TOKENIZER_DIR,
        ("tokenizer_dir", "checkpoint_dir", "model_name"),
        "the tokenizer folder",
    )
    save_model_folder(tensors(), config, out_dir, tokenizer_source_dir=tokenizer_dir)


def _write_lora_folder(
    step_dir: Path,
    state: dict[str, Any],
    config: Config,
    reader: ShardedReader,
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    out_dir: Path,
) -> None:
    arguments = state.get("arguments") or {}
    try:
        lora = LoRAConfig(**{k: v for k, v in arguments["lora"].items() if k != "class"})
    except (KeyError, AttributeError, TypeError, ValueError, LitsftError) as err:
        raise LitsftError(
            f"{step_dir}/{TRAINER_STATE} records no valid LoRA settings ({err!r}); pass another step checkpoint "
            "of that run, or its final/"
        ) from None
    with torch.device("meta"):
        adapter_names = list(lora_state_dict(apply_lora(Transformer(config), lora)))
    derived = [name for name in adapter_names if name not in stored]
    if derived:
        # Tensors final/ holds that training derives from the base and does not checkpoint (PiSSA's initial
        # A and B, from an SVD whose bits depend on the device that ran it).
        raise LitsftError(
            f"{step_dir} holds the trained adapters of a --lora.variant {lora.variant} run but not "
            f"{derived[0]}, which its final/ holds and training derives from the base; to get the model of its "
            f"step {state.get('step')}, run `litsft finetune_lora <that run's model and --data options> --resume "
            f"{step_dir} --train.max_steps {state.get('step')} --out_dir <a new dir>`"
        )
    base_dir = _recorded_dir(step_dir, state, FROZEN_BASE, ("checkpoint_dir",), "the base model")
    recorded = state.get(FROZEN_FINGERPRINT)
    if recorded is not None and weights_fingerprint(base_dir) != recorded:
        raise LitsftError(
            f"the weights in {base_dir} changed since the adapters in {step_dir} were trained on them "
            f"(recorded fingerprint {str(recorded)[:12]}); restore the base checkpoint they were trained on"
        )
    adapters = {name: _read(reader, name, stored[name]) for name in adapter_names}
    save_lora_folder(adapters, lora, base_dir, out_dir, base_quantization=arguments.get("quantize"))


def _check_holds(
    step_dir: Path, stored: dict[str, tuple[tuple[int, ...], torch.dtype]], names: list[str]
) -> None:
    missing = [name for name in names if name not in stored]
    if missing:
        raise LitsftError(
            f"{step_dir} has no weights for {missing[:3]} of the model its {TRAINER_STATE} describes; pass "
            "another step checkpoint of that run, or its final/"
        )


def _read(reader: ShardedReader, name: str, info: tuple[tuple[int, ...], torch.dtype]) -> torch.Tensor:
    """The whole tensor `model/<name>`, merged from every rank's parts, in the dtype it was stored in."""
    shape, dtype = info
    tensor = torch.empty(shape, dtype=dtype)
    reader.load({MODEL_PREFIX + name: tensor}, collective=False)
    return tensor


def _recorded_dir(
    step_dir: Path, state: dict[str, Any], key: str, fallbacks: tuple[str, ...], what: str
) -> Path:
    """A folder the run read and its final/ takes files from: recorded in trainer_state.json, or for a
    checkpoint written before it was, the run's own argument as given (relative to this directory)."""
    arguments = state.get("arguments") or {}
    recorded = state.get(key) or next((arguments[name] for name in fallbacks if arguments.get(name)), None)
    if recorded is None or not Path(recorded).is_dir():
        raise LitsftError(
            f"{what} of the run that wrote {step_dir} ({recorded}) is not there, and the model of the step "
            "takes files from it; restore that folder there"
        )
    return Path(recorded)
