"""How the model is prepared for training on its devices: `parallelize` applies activation checkpointing,
torch.compile and FSDP2 to it, in that order, and is the one place that decides sharding.

Every sharding strategy is FSDP2 (`fully_shard`) on a device mesh, run through Fabric's
ModelParallelStrategy. FSDP2 runs unpatched on CPU (gloo) and GPU (NCCL), and its hybrid mode is
correct where FSDP1's silently drops the cross-replica all-reduce (measured: tutorials/cpu_distributed.md):

| strategy      | mesh                          | reshard_after_forward |
|---------------|-------------------------------|-----------------------|
| FULL_SHARD    | 1-D, all ranks                | True  (ZeRO-3)        |
| SHARD_GRAD_OP | 1-D, all ranks                | False (ZeRO-2)        |
| HYBRID_SHARD  | 2-D (nodes, devices per node) | True: shard in a node, replicate across nodes |
| NO_SHARD      | 2-D (all ranks, 1)            | replicate everywhere (DDP)                    |

One process runs without FSDP (activation checkpointing and compile still apply), its mixed precision
Fabric's autocast; so FSDP's CPU offload needs 2 or more processes (`validation.check_fsdp_options`).

Which ranks shard, replicate and share sequences is `litsft.training.layout.ParallelLayout`'s to say: here
its meshes are made (`fsdp_mesh`, and `context_shard`'s process group for context parallelism, whose ranks
FSDP treats as any other: they shard parameters and reduce gradients with the data ranks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.expert_parallel import ExpertShard, shard_experts
from litsft.model.network.moe import GroupedExperts
from litsft.model.precision.float8 import Float8Recipe, convert_to_float8
from litsft.model.precision.quantization import is_nf4
from litsft.training.args import FSDPConfig, Precision, ShardingStrategy
from litsft.training.devices import Device
from litsft.training.layout import ParallelLayout


def build_fabric(
    layout: ParallelLayout,
    precision: Precision,
    fsdp: FSDPConfig,
    accelerator: Device,
    compile_blocks: bool = False,
    float8: Float8Recipe | None = None,
) -> Fabric:
    """A Fabric for the processes of `layout` on `accelerator` (CPU processes talk over gloo). With more than
    one, `fabric.setup_module` runs `parallelize` (FSDP2-sharded as the layout says); one process calls
    `parallelize(model, None, ...)` itself."""
    if not layout.sharded:
        return Fabric(accelerator=accelerator, devices=1, num_nodes=1, precision=precision)

    def parallelize_for_strategy(model: nn.Module, fabric_mesh: DeviceMesh) -> nn.Module:
        mesh = fsdp_mesh(layout, fabric_mesh)
        experts = expert_meshes(layout, fabric_mesh.device_type)
        return parallelize(model, mesh, fsdp, precision, compile_blocks, float8, experts)

    # No tensor parallelism: Fabric's mesh is (world size, 1). Context ranks are data-parallel ranks as far
    # as FSDP goes (they shard parameters and reduce gradients like any other); that they read the same
    # micro-batch is the loaders' business (`ParallelLayout.data_rank`), not Fabric's.
    strategy = ModelParallelStrategy(
        parallelize_fn=parallelize_for_strategy,
        data_parallel_size=layout.world_size,
        tensor_parallel_size=1,
    )
    # Fabric's autocast would cast inside every op; with FSDP2 the cast happens once per all-gather
    # (MixedPrecisionPolicy below), so Fabric only needs to know about true-precision modes.
    fabric_precision = "32-true" if precision == "bf16-mixed" else precision
    return Fabric(
        accelerator=accelerator,
        devices=layout.devices,
        num_nodes=layout.num_nodes,
        strategy=strategy,
        precision=fabric_precision,
    )


def fsdp_mesh(layout: ParallelLayout, fabric_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards on, of the shape `ParallelLayout.fsdp_mesh_shape` says (FSDP2 reads a 1-D mesh as
    "shard over these ranks" and a 2-D one as (replicate, shard)): Fabric's (world size, 1) mesh or its
    first dimension where that is the shape, so no process group is made twice."""
    device_type = fabric_mesh.device_type
    if device_type == "cpu":
        # Fabric materializes the sharded model with each module's reset_parameters(), a random op on
        # DTensors, and torch warns once per rank that DTensor random ops are incomplete on CPU meshes.
        # Harmless here: the recipe's initialize() then overwrites every parameter (loaded weights, or
        # weights drawn from per-parameter seeded generators), so no value from that op survives.
        warnings.filterwarnings(
            "ignore", message="DTensor random operators may not have complete support on cpu device mesh"
        )
    shape, names = layout.fsdp_mesh_shape
    if shape == tuple(fabric_mesh.shape):
        return fabric_mesh  # NO_SHARD: (world size, 1), replicate everywhere, shards of one rank
    if shape == (layout.world_size,):
        return fabric_mesh["data_parallel"]
    # HYBRID_SHARD: Fabric's mesh has no node dimension.
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def expert_meshes(layout: ParallelLayout, device_type: str) -> ExpertMeshes | None:
    """The meshes of expert parallelism (None without it): the expert group's, which holds each rank's experts
    (`layout.expert_rank`), and the one FSDP2 shards the experts' weights on, both of one mesh of the shape
    `layout.expert_fsdp_mesh_shape` (FSDP2 asks that a parameter's own mesh and its FSDP mesh have one root).
    Collective: every rank calls it, after the process group started."""
    if layout.expert == 1:
        return None
    shape, names = layout.expert_fsdp_mesh_shape
    root = init_device_mesh(device_type, shape, mesh_dim_names=names)
    expert = root["expert"]
    shard = ExpertShard(expert.get_group(), expert.get_local_rank(), layout.expert)
    return ExpertMeshes(expert, root[names[:-1]], shard, layout.world_size)


@dataclass(frozen=True)
class ExpertMeshes:
    """Where the experts' weights live under expert parallelism (`expert_meshes`)."""

    expert: DeviceMesh
    """The expert group's 1-D mesh: each weight is sharded along its experts (dim 0) over it."""
    fsdp: DeviceMesh
    """The mesh FSDP2 shards (and under HYBRID_SHARD replicates) the experts' weights on."""
    shard: ExpertShard
    world_size: int
    """What FSDP2 divides the experts' gradients by, as it divides every other gradient: its own mesh is
    `expert` times smaller, and the all-to-all's backward already summed the expert group's tokens."""


def context_shard(layout: ParallelLayout, global_rank: int, device_type: str) -> ContextShard | None:
    """This rank's place in its context group (None without context parallelism). Collective: every rank
    calls it once, after the process group started. The groups are `layout.context` consecutive ranks, of
    one node: their all-to-alls run every attention layer, over the fastest links."""
    if layout.context == 1:
        return None
    mesh = init_device_mesh(
        device_type, (layout.data_replicas, layout.context), mesh_dim_names=("data", "context")
    )
    return ContextShard(mesh["context"].get_group(), layout.context_rank(global_rank), layout.context)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    fsdp: FSDPConfig,
    precision: Precision,
    compile_blocks: bool = False,
    float8: Float8Recipe | None = None,
    experts: ExpertMeshes | None = None,
) -> nn.Module:
    """Prepare `model` (in place; parameter names do not change) for training: its large block projections
    swapped for float8 ones if asked (`litsft.model.precision.float8`), activation checkpointing on each block if asked,
    then each block and the loss's cross-entropy compiled if asked, then FSDP2 on `mesh` (None: one process,
    no FSDP). The order matters: compile sees the float8 casts and the recomputation, and FSDP wraps the
    compiled blocks (and all-gathers tensorwise float8 weights in float8 when it shards them). With `experts`
    (expert parallelism) each MoE layer's experts keep only this rank's experts, first of all."""
    if experts is not None:
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                shard_experts(module, experts.shard, experts.expert)
    if float8 is not None:
        sharded = mesh is not None and mesh.size(mesh.ndim - 1) > 1
        convert_to_float8(model, float8, fsdp_all_gather=sharded and float8 == "tensorwise")
    if fsdp.activation_checkpointing:
        for block in model.blocks:
            recompute_in_backward(block)
    if compile_blocks:
        # Dynamic shapes from the first compilation: every packed batch brings a new document layout (the
        # number of real tokens, the number of documents in cu_seqlens, the longest one, an int varlen_attn
        # takes). Compiled for the first shapes it saw, a block would recompile for the next ones; with
        # dynamic=True they are symbols and one graph serves every layout (tests/test_model_network_attention.py checks
        # that nothing recompiles). Parameters keep static shapes.
        for block in model.blocks:
            block.compile(dynamic=True)
        model.loss_compiled = True
    if mesh is not None:
        fully_shard_blocks(model, mesh, fsdp, precision, experts)
    return model


def recompute_in_backward(block: nn.Module) -> None:
    """Activation checkpointing: in training, `block` keeps only its inputs and runs its forward again in the
    backward pass (less memory, about 1/3 more compute). Its forward is replaced on the instance, not
    wrapped in another module, so parameter names stay those of checkpoints and exports."""
    forward = block.forward

    def forward_recomputed_in_backward(*args: Any, **kwargs: Any) -> Any:
        if not block.training:
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = forward_recomputed_in_backward


def fully_shard_blocks(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FSDPConfig,
    precision: Precision,
    experts: ExpertMeshes | None = None,
) -> None:
    """Shard each transformer block as its own FSDP unit, then the root (embeddings, final norm, head). Under
    expert parallelism (`experts`) each block's experts are a unit of their own first, on the experts' mesh.

    A block is one unit also under LoRA, its frozen base and its adapters together: one all-gather and one
    reduce-scatter per block, and no FSDP hook between the block's layers, which would break a compiled
    block into pieces (FSDP2's hooks are not traced). FSDP2 takes frozen and trainable parameters in one
    unit: it all-gathers both and reduce-scatters the gradients of the trainable ones only (the parameters
    that have a gradient, `FSDPParamGroup.post_backward` in torch/distributed/fsdp/_fully_shard/).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        # fp32 master weights and gradient reduction, bf16 compute.
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=True) if fsdp.cpu_offload else OffloadPolicy()
    reshard = fsdp.sharding_strategy != "SHARD_GRAD_OP"
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    if mesh.size(mesh.ndim - 1) == 1:
        # Shards of one rank (NO_SHARD, HYBRID_SHARD with one device per node): every rank holds the whole
        # frozen NF4 weights (QLoRA) anyway, and torchao's NF4 all-gather hooks do not handle a group of one,
        # so FSDP leaves them alone; being frozen, they need no gradient reduction either.
        options["ignored_params"] = {p for p in model.parameters() if is_nf4(p)}

    for block in model.blocks:
        if experts is not None:
            for module in block.modules():
                if isinstance(module, GroupedExperts):
                    unit = fully_shard(
                        module, reshard_after_forward=reshard, **{**options, "mesh": experts.fsdp}
                    )
                    unit.set_gradient_divide_factor(float(experts.world_size))
                    # Summed, then divided: a factor other than the mesh's size is otherwise a PREMUL_SUM
                    # reduce-scatter, which gloo (the CPU) does not have. Not over one rank, which reduces
                    # nothing: torch 2.13 then divides by the factor twice (`foreach_reduce`'s copy for a
                    # world of one, then the post-division that forced sums add).
                    if experts.fsdp.size(experts.fsdp.ndim - 1) > 1:
                        unit.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard, **options)
    # The root's parameters are needed again right at the start of backward; keeping them saves one all-gather.
    fully_shard(model, reshard_after_forward=False, **options)


def synchronize_gradients(model: nn.Module, strategy: ShardingStrategy, last_micro_batch: bool) -> None:
    """Set how the next backward pass of gradient accumulation reduces its gradients across ranks.

    Sharded strategies (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) reduce-scatter every micro-batch, as
    torchtitan does: skipping it (FSDP2's `set_requires_gradient_sync(False)`, Fabric's `no_backward_sync`)
    would keep every unit's whole unsharded gradient on every rank until the last micro-batch, and in fp32
    under bf16-mixed (FSDP2 upcasts it to the reduce dtype to accumulate: `to_accumulated_grad_if_needed` in
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py): 4 bytes per parameter of the whole model, the memory
    that sharding was meant to save. HYBRID_SHARD reduce-scatters within a node each micro-batch and
    all-reduces across nodes only on the last one. NO_SHARD holds whole gradients anyway: it all-reduces on
    the last micro-batch only. One process (no FSDP): nothing to do.

    The strategy is named, not read off the parameters: after an evaluation forward pass the units that
    are not resharded (the root, SHARD_GRAD_OP's blocks) hold plain unsharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        unit.set_requires_gradient_sync(last_micro_batch or strategy != "NO_SHARD", recurse=False)
        if strategy == "HYBRID_SHARD":
            unit.set_requires_all_reduce(last_micro_batch, recurse=False)


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit's sharded parameters back in the model after forward passes without a backward
    (validation, a reference pass): the units that are not resharded after forward (the root, SHARD_GRAD_OP's
    blocks) keep their unsharded parameters registered until a backward pass reshards them, and a checkpoint
    saved in between would name the model's parameters by tensors the optimizer does not hold. One process (no
    FSDP): nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
