"""MXFP4 weights on the hub (gpt-oss's experts): each tensor `X` stored as `X_blocks` (..., R, G, 16) uint8, two
4-bit E2M1 values per byte (the low nibble first), and `X_scales` (..., R, G) uint8, a power-of-two exponent
biased by 127 for each group of 32 values (the OCP Microscaling format,
https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf). Conversion dequantizes
them into the dense tensor `X` transformers builds (the last two dims swapped, as its unquantized checkpoints
store it), exactly as transformers' integrations/mxfp4.py `convert_moe_packed_tensors` does, and writes bf16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from litsft.errors import LitsftError

BLOCKS, SCALES = "_blocks", "_scales"
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The E2M1 value of each 4-bit code."""
SCALE_BIAS = 127
DEQUANTIZED_DTYPE = torch.bfloat16
"""What transformers dequantizes to, and what every MXFP4 value times its power of two fits in exactly."""


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DEQUANTIZED_DTYPE
) -> torch.Tensor:
    """`X_blocks` (E, R, G, B) and `X_scales` (E, R, G) -> `X` (E, G * B * 2, R): each code's value times
    2 ** (scale - 127), the low nibble before the high one, the last two dims swapped."""
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, width = blocks.shape
    blocks = blocks.to(torch.uint8).reshape(-1, width)
    exponents = (scales.to(torch.int32) - SCALE_BIAS).reshape(-1, 1)
    out = torch.empty(blocks.shape[0], width * 2, dtype=dtype, device=blocks.device)
    out[:, 0::2] = table[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = table[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `dequantize` gives blocks of `blocks_shape` (E, R, G, B): (E, G * B * 2, R)."""
    experts, rows, groups, width = blocks_shape
    return (experts, groups * width * 2, rows)


def packed_tensors(
    infos: Mapping[str, tuple[tuple[int, ...], torch.dtype]], files: Mapping[str, object]
) -> dict[str, tuple[str, str]]:
    """The MXFP4 tensors among a checkpoint's (name -> (shape, dtype)): `X` -> (`X_blocks`, `X_scales`). A
    layout this does not dequantize (a blocks tensor without its scales, other dtypes or shapes) is refused."""
    packed = {}
    for name in infos:
        if not name.endswith((BLOCKS, SCALES)):
            continue
        stem = name[: -len(BLOCKS)]
        blocks, scales = stem + BLOCKS, stem + SCALES
        if blocks not in infos or scales not in infos:
            missing = scales if blocks in infos else blocks
            raise LitsftError(
                f"{files[name]}: {name!r} is half of an MXFP4 tensor whose {missing!r} is missing; the checkpoint "
                "is incomplete, download it again"
            )
        (blocks_shape, blocks_dtype), (scales_shape, scales_dtype) = infos[blocks], infos[scales]
        if (
            len(blocks_shape) != 4
            or blocks_shape[:-1] != scales_shape
            or blocks_dtype != torch.uint8
            or scales_dtype != torch.uint8
        ):
            raise LitsftError(
                f"{files[name]}: MXFP4 tensor {stem!r} has blocks {list(blocks_shape)} ({blocks_dtype}) and scales "
                f"{list(scales_shape)} ({scales_dtype}), but litsft dequantizes uint8 blocks (E, rows, groups, 16) "
                "with uint8 scales (E, rows, groups) only; convert it with transformers (dequantize=True) first"
            )
        packed[stem] = (blocks, scales)
    return packed


def dequantized(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of a checkpoint's tensors with each MXFP4 pair (`packed_tensors` checked them) replaced by
    its dequantized tensor, once both halves have passed."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if not name.endswith((BLOCKS, SCALES)):
            yield name, tensor
            continue
        stem = name[: -len(BLOCKS)]
        partner = stem + (SCALES if name.endswith(BLOCKS) else BLOCKS)
        if partner not in held:
            held[name] = tensor
            continue
        pair = {name: tensor, partner: held.pop(partner)}
        yield stem, dequantize(pair[stem + BLOCKS], pair[stem + SCALES])
    if held:
        raise KeyError(f"MXFP4 halves without their partner: {sorted(held)}")
