"""The torch (and torchao) functions litsft calls on its CUDA path and to write checkpoints (DCP) take the
arguments litsft passes them, in the installed versions: run on the CPU by CI (torch 2.13) and on the GPU image
(torch 2.11.0+cu130, torchao 0.17.0) by benchmarks/gpu/run.sh, so a signature that moved fails here by name
rather than at the first GPU step. What torch 2.11 has is tabled in benchmarks/gpu/README.md."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from litsft.model.network import attention
from litsft.model.precision import quantization

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

# (module, attribute path, the positional arguments litsft passes in order, the keywords it passes)
CALLS = [
    ("torch.nn.attention.flex_attention", "flex_attention", ("query", "key", "value", "score_mod"),
     ("block_mask", "scale", "enable_gqa")),
    ("torch.nn.attention.flex_attention", "BlockMask.from_kv_blocks",
     ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"),
     ("BLOCK_SIZE", "mask_mod", "seq_lengths")),
    ("torch", "compile", ("model",), ("dynamic",)),
    ("torch.compiler", "is_compiling", (), ()),
    ("torch.distributed.fsdp", "fully_shard", ("module",),
     ("mesh", "reshard_after_forward", "mp_policy", "offload_policy", "ignored_params")),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", (), ("param_dtype", "reduce_dtype")),
    ("torch.distributed.fsdp", "CPUOffloadPolicy", (), ("pin_memory",)),
    ("torch.distributed.fsdp", "FSDPModule.set_requires_gradient_sync", ("self", "requires_gradient_sync"),
     ("recurse",)),
    ("torch.distributed.fsdp", "FSDPModule.set_requires_all_reduce", ("self", "requires_all_reduce"),
     ("recurse",)),
    ("torch.distributed.checkpoint", "save", ("state_dict",), ("storage_writer", "no_dist")),
    ("torch.distributed.checkpoint", "async_save", ("state_dict",),
     ("storage_writer", "process_group", "async_stager", "no_dist")),
    ("torch.distributed.checkpoint.staging", "BlockingAsyncStager", (), ("cache_staged_state_dict",)),
    ("torch.distributed.checkpoint", "load", ("state_dict",), ("storage_reader", "no_dist")),
    ("torch.distributed.checkpoint", "HuggingFaceStorageWriter", ("path",),
     ("save_distributed", "enable_consolidation", "fqn_to_index_mapping")),
    ("torch.distributed.checkpoint", "HuggingFaceStorageReader", ("path",), ()),
    ("torch.nn.utils", "clip_grad_norm_", ("parameters", "max_norm"), ("foreach",)),
    ("torch.utils.checkpoint", "checkpoint", ("function",), ("use_reentrant",)),
    ("torch.optim", "AdamW", ("params",), ("lr", "betas", "eps", "weight_decay", "fused")),
    ("torch.cuda", "max_memory_allocated", ("device",), ()),
    ("torch.cuda", "get_device_capability", ("device",), ()),
    ("torch.cuda", "get_device_name", ("device",), ()),
    ("torch.cuda", "is_bf16_supported", (), ()),
    ("torchao.float8", "convert_to_float8_training", ("module",), ("module_filter_fn", "config")),
    ("torchao.float8", "Float8LinearConfig", (), ("enable_fsdp_float8_all_gather",)),
    ("torchao.float8", "Float8LinearConfig.from_recipe_name", ("recipe_name",), ()),
    ("torchao.float8", "precompute_float8_dynamic_scale_for_fsdp", ("module",), ()),
    (quantization.torchao_nf4, "to_nf4", ("tensor", "block_size", "scaler_block_size"), ()),
]  # fmt: skip


def resolve(module: str | Callable[[], ModuleType], path: str) -> Any:
    """`module.path`; `module` is a module's name or litsft's function finding it (where versions moved it)."""
    target: Any = importlib.import_module(module) if isinstance(module, str) else module()
    for name in path.split("."):
        target = getattr(target, name)
    return target


@pytest.mark.parametrize(("module", "path", "positional", "keywords"), CALLS, ids=[c[1] for c in CALLS])
def test_the_functions_litsft_calls_take_its_arguments(module, path, positional, keywords):
    parameters = list(inspect.signature(resolve(module, path)).parameters.values())
    in_order = [p.name for p in parameters if p.kind in POSITIONAL][: len(positional)]
    assert tuple(in_order) == positional, (
        f"{module}.{path} takes {in_order} first, litsft passes {positional}"
    )
    by_name = {p.name: p for p in parameters}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
    for name in keywords:
        assert (name in by_name and by_name[name].kind in KEYWORD) or takes_any, (
            f"{module}.{path}: no {name}="
        )


def test_nn_module_compile_passes_dynamic_to_torch_compile():
    """`block.compile(dynamic=True)` (litsft.training.parallel): Module.compile hands its arguments over."""
    seen = {}
    module = torch.nn.Linear(2, 2)
    original = torch.compile
    try:
        torch.compile = lambda forward, **options: seen.update(options) or forward
        module.compile(dynamic=True)
    finally:
        torch.compile = original
    assert seen == {"dynamic": True}


def test_varlen_attn_can_be_asked_for_causal_attention():
    """`_varlen` asks for causality with window_size=(-1, 0) (torch 2.11 and newer) or is_causal (2.10), and
    takes the scale where the signature has it; a varlen_attn with neither of the first two would attend to
    later tokens."""
    varlen_attn = attention._varlen_attn()
    if varlen_attn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen; choose_kernel uses flex")
    parameters = inspect.signature(varlen_attn).parameters
    positional = [name for name, p in parameters.items() if p.kind in POSITIONAL][:7]
    assert positional == ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
    assert attention.varlen_features(varlen_attn) & {"window_size", "is_causal"}
    if torch.__version__.startswith("2.11."):
        # torch 2.11.0's: window_size and scale, no enable_gqa (kv heads are repeated for it).
        assert attention.varlen_features(varlen_attn) == {"window_size", "scale"}


def test_sdpa_takes_the_options_litsft_passes():
    """F.scaled_dot_product_attention is a builtin without a Python signature: called with every keyword."""
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.5, enable_gqa=True
    )
    assert out.shape == q.shape


def test_grouped_mm_takes_offsets():
    """torch._grouped_mm (litsft.model.network.moe on CUDA, `torch._grouped_mm(a, b, offs=offsets)`) is a builtin: its
    signature is read from the stub torch ships with it, torch/_C/_VariableFunctions.pyi."""
    import ast
    from pathlib import Path

    stub = Path(torch.__file__).parent / "_C" / "_VariableFunctions.pyi"
    functions = [
        node for node in ast.parse(stub.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "_grouped_mm"
    ]  # fmt: skip
    assert functions and hasattr(torch, "_grouped_mm"), f"torch {torch.__version__} has no _grouped_mm"
    assert [a.arg for a in functions[0].args.args][:3] == ["input", "mat2", "offs"]


def test_autocast_queries_take_a_device_type():
    assert torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)
    assert torch.is_autocast_enabled("cpu") is False


def test_the_host_allocators_cache_can_be_emptied():
    """Closing a GPU run's page-locked staging buffers (sharded_tensors.pinned_stager) empties the host
    allocator's cache: the call litsft finds for it exists in this torch (public in 2.13, private in 2.11)."""
    from litsft.checkpoint.sharded_tensors import empty_host_cache

    assert callable(empty_host_cache())
