"""float8 training (`--train.float8`): the blocks' large projections run their three matmuls (forward, and
the two of the backward pass) in float8 on the GPU's float8 tensor cores, through torchao's float8 training
(https://github.com/pytorch/ao/tree/main/torchao/float8). Weights, gradients and optimizer state keep their
dtypes; each matmul casts its operands to float8 with scales computed from their current absolute maximum
(dynamic scaling), so nothing is calibrated and nothing changes in checkpoints or exports: torchao's
Float8Linear is an nn.Linear with the same parameters.

| `--train.float8` | scales                                      | FSDP2 all-gather of the weights                   |
|------------------|---------------------------------------------|---------------------------------------------------|
| tensorwise       | one per tensor                              | in float8 (half of bf16's bytes); every weight's scale computed at once after the optimizer step (`precompute_float8_scales`) |
| rowwise          | one per row: more accurate with outliers, slower | in bf16                                      |

One process (no FSDP) holds its weights whole and casts them in each forward, whichever the scaling.

Published figure (torchao's docs, docs/source/workflows/training.md at v0.17.0): Llama-3-8B on 8 H100s, FSDP2,
torch.compile, sequence length 8192: 6,150 tokens/s/GPU in bf16, 7,689.5 with tensorwise and float8
all-gather (+25%), 6,768 with rowwise (+10%).

Which layers: a float8 matmul gains only where it is large enough for the casts to pay for themselves.
`converts_to_float8` keeps in bf16 every layer outside the blocks (the output head, whose weight is tied
to the embedding in many models), every layer with a dimension not divisible by 16 (the float8 kernels'
requirement) and the layers below the sizes where torchao's H100 microbenchmarks measured no gain (its
`_auto_filter_for_recipe` thresholds, torchao/float8/float8_linear_utils.py at v0.17.0).

float8 tensor cores exist on compute capability 8.9 and newer (Ada, Hopper, Blackwell): torch's float8
matmul `_scaled_mm` runs there only (https://github.com/pytorch/pytorch/blob/main/test/test_scaled_matmul_cuda.py:
"FP8 is only supported on H100+, SM 8.9 and MI300+ devices"). `check_float8_device` refuses everything else in
one line before a process starts, and `check_float8_recipe` refuses finetune_lora. torch is imported only inside
the functions that need it: the checks before launch run without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from litsft.errors import LitsftError

if TYPE_CHECKING:
    import torch
    from torch import nn

Float8Recipe = Literal["tensorwise", "rowwise"]
FLOAT8_CAPABILITY = (8, 9)
"""The first compute capability with float8 tensor cores (Ada Lovelace, e.g. L4, RTX 4090); H100 is (9, 0)."""
FLOAT8_RECIPES = ("finetune_full", "pretrain")
"""The recipes that train whole weights. LoRA's base is frozen and its adapters are rank-r matmuls, far
below the sizes where float8 gains."""


def check_float8_recipe(recipe: Float8Recipe | None, recipe_name: str) -> None:
    """Refuse, in one line, `--train.float8` for a recipe that trains no whole weights."""
    if recipe is not None and recipe_name not in FLOAT8_RECIPES:
        raise LitsftError(
            f"--train.float8 {recipe} is for finetune_full and pretrain: {recipe_name}'s base weights are frozen "
            "and its adapters are too small for float8 to gain; drop --train.float8"
        )


def check_float8_device(
    recipe: Float8Recipe | None,
    precision: str,
    device_type: str,
    capability: tuple[int, int] | None = None,
    device_name: str = "",
) -> None:
    """Refuse, in one line, a `--train.float8` that this device (its compute capability and name, on CUDA) or
    precision cannot run."""
    if recipe is None:
        return
    option = f"--train.float8 {recipe}"
    if device_type != "cuda":
        raise LitsftError(
            f"{option} needs a CUDA GPU with float8 tensor cores (compute capability 8.9 or newer: L4, RTX 4090, "
            f"H100, B200); this run is on the {device_type.upper()}; drop --train.float8"
        )
    if capability is not None and capability < FLOAT8_CAPABILITY:
        raise LitsftError(
            f"{option} needs float8 tensor cores (compute capability 8.9 or newer: L4, RTX 4090, H100, B200); "
            f"this GPU ({device_name or 'GPU'}, {capability[0]}.{capability[1]}) has none; drop --train.float8"
        )
    if not precision.startswith("bf16"):
        raise LitsftError(
            f"{option} runs the other layers in bf16: use --precision bf16-mixed (or bf16-true), not {precision}"
        )


def converts_to_float8(name: str, linear: nn.Linear, recipe: Float8Recipe) -> bool:
    """Whether the linear layer `name` (its name in the model) is swapped for a float8 one under `recipe`."""
    if not name.startswith("blocks."):
        return False  # the output head (and anything else outside the blocks) stays in bf16
    out_features, in_features = linear.weight.shape  # N, K of the forward matmul
    if out_features % 16 or in_features % 16:
        return False
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    return not (out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048))


def float8_layer_names(model: nn.Module, recipe: Float8Recipe) -> list[str]:
    """The names of the linear layers `convert_to_float8` swaps."""
    from torch import nn

    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and converts_to_float8(name, module, recipe)
    ]


def convert_to_float8(model: nn.Module, recipe: Float8Recipe, fsdp_all_gather: bool) -> list[str]:
    """Swap the layers `converts_to_float8` picks for torchao's Float8Linear, in place (on the meta device
    too: before the model is materialized and sharded); returns their names. `fsdp_all_gather`: tensorwise
    weights all-gathered in float8 by FSDP2 (then call `precompute_float8_scales` after each optimizer step)."""
    from litsft.model.precision.quantization import import_torchao

    float8 = import_torchao("torchao.float8")
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)
    else:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
    chosen = set(float8_layer_names(model, recipe))
    float8.convert_to_float8_training(
        model, module_filter_fn=lambda module, name: name in chosen, config=config
    )
    return sorted(chosen)


def without_float8_wrapper(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside the wrapper that float8 all-gather puts around a weight (torchao's
    WeightWithDynamicFloat8CastTensor, which safetensors cannot write); any other tensor as it is. The two
    share storage: writing into the one writes into the other."""
    return tensor._tensor if type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor" else tensor


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every weight that FSDP2 all-gathers in float8, in one
    all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`); nothing when there are none."""
    from litsft.model.precision.quantization import import_torchao

    import_torchao("torchao.float8").precompute_float8_dynamic_scale_for_fsdp(model)
