"""Memory planner: the device memory one training step needs, per device, worked out before launching it.

`plan`, the `litsft plan` command, takes a recipe's own options (litsft.training.args' FSDPConfig, TrainConfig and
LoRAConfig), so a recipe's YAML plans the run it describes. `estimate_memory` is
arithmetic over a `Config`, LoRA adapters counted on the model built with the run's variant and targets on
the meta device (`adapter_parameters`; a variant's untrained buffers, PiSSA's initial A and B, held whole on
every device: `adapter_buffer_bytes`), modelling the engine in litsft/training/parallel.py: FSDP2 `fully_shard` on every
transformer block and on the root (embeddings, final norm, output head), through Fabric's
ModelParallelStrategy; one process runs without FSDP. The byte counts:

| precision  | stored parameters | gradients | AdamW exp_avg + exp_avg_sq | compute copy |
|------------|-------------------|-----------|----------------------------|--------------|
| bf16-mixed | fp32, sharded     | fp32      | 2 x fp32                   | bf16         |
| 16-mixed   | fp32, sharded     | fp32      | 2 x fp32                   | fp16         |
| bf16-true  | bf16              | bf16      | 2 x fp32, + bf16 Kahan compensation | none needed |
| 32-true    | fp32              | fp32      | 2 x fp32                   | none needed  |

LoRA's frozen base is stored in the compute dtype (bf16 under bf16-mixed: no fp32 master copy, no compute
copy; litsft.training.engine.store_frozen_in_compute_dtype); its adapters are stored like trained parameters. With
`--quantize nf4` (QLoRA) the adapted block projections are stored, sharded and all-gathered in NF4
(litsft.model.precision.quantization.NF4_BYTES_PER_WEIGHT: 4 bits plus the scales), and each is dequantized for its matmul,
one at a time (NF4_DEQUANTIZE_BYTES per weight of the largest one, a transient). Loading quantizes each NF4
weight whole on every rank, one at a time, before any optimizer state exists: the largest one's fp32 values
and torchao's working memory (`nf4_loading_bytes`, 128 MiB of it fixed) on top of the parameters. The run's
peak is the larger of that and a step's: loading's for a small model at a short sequence.

Parameters, gradients and optimizer states are divided by the shard group that
litsft.training.layout.ParallelLayout names (the one reading of the sharding strategy and the context size):
every rank for FULL_SHARD and SHARD_GRAD_OP, the devices of one node for HYBRID_SHARD, one (replicated) for
NO_SHARD; context ranks count as data ranks there. With `--parallel.context N` a rank holds 1/N of every row's
tokens (a micro-batch's rows joined into one, padded to a multiple of N), so its activations shrink about
N-fold, and each attention layer adds its all-to-all's tensors (`context_attention_bytes`); gradient
accumulation follows the data replicas. With `--parallel.expert N` the experts' resting shards are the
same (efsdp x N ranks = the shard group), but a block's experts are all-gathered over efsdp only, E/N experts
instead of E, and each MoE layer adds its dispatch buffers (`expert_dispatch_bytes`). On top come activations and transients (all-gathered compute-dtype
parameters, a chunk of logits, gradient-reduction buffers). Everything the model rests on is a named constant
below, so that a calibration test can compare `estimate_memory` with measured peaks and adjust them.

The peak: parameters and AdamW states live through the whole step. Gradients do not exist during the
forward pass (the engine zeroes them with set_to_none) unless an earlier micro-batch of the same step left
them there (gradient accumulation); the backward pass frees activations as it creates gradients. So the
total is parameters + optimizer states + the larger of (activations + transients) and gradients, or
their sum when accumulating. Accumulated gradients stay sharded: the engine reduce-scatters each
micro-batch's gradients (litsft.training.parallel.synchronize_gradients), one reduce-scatter per micro-batch instead
of per step; held whole until the last micro-batch they would take `whole_gradients` on every device (fp32
under bf16-mixed, where FSDP2 accumulates in the reduce dtype), which `litsft plan` prints beside them. On this CPU, 2 processes, a 51M-parameter model, 32-true, that total is within
15% of the measured peak for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD
(benchmarks/bench_plan_vs_measured.py; adding every term, as before, overestimated by 28-33%). What every process
holds besides the total, its runtime (RUNTIME_BYTES: Python, torch, Lightning) and on a GPU the CUDA context
(CUDA_CONTEXT_BYTES), is printed under it (`runtime_summary`): for a small model it is most of the process.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from litsft.checkpoint.checkpoint_dirs import is_step_checkpoint, step_model_config
from litsft.errors import LitsftError
from litsft.model.accounting.sizes import block_saved_bytes_per_token, model_sizes, num_parameters
from litsft.model.config import Config, format_count
from litsft.model.lora.config import LoRAConfig, Quantization
from litsft.model.lora.layers import EXPERT_TARGETS, apply_lora, base_weight_name
from litsft.model.network.loss import FP32_BYTES_PER_LOGIT, loss_chunk_tokens
from litsft.model.network.transformer import Transformer
from litsft.model.precision.quantization import NF4_BLOCK_SIZE, NF4_BYTES_PER_WEIGHT
from litsft.training.args import (
    MAX_DEFAULT_SEQ_LENGTH,
    Accelerator,
    EvalConfig,
    FSDPConfig,
    LogConfig,
    ObjectiveConfig,
    OptimizerConfig,
    ParallelConfig,
    Precision,
    TrainConfig,
    step_geometry,
)
from litsft.training.devices import gpu_has_bf16
from litsft.training.layout import ParallelLayout, ShardingStrategy

# (bytes of a stored parameter, bytes of a parameter as the matmuls see it). Gradients take the stored dtype: FSDP2 reduces gradients in fp32 (reduce_dtype) into the fp32 shards.
PARAMETER_BYTES: dict[str, tuple[int, int]] = {
    "bf16-mixed": (4, 2),
    "16-mixed": (4, 2),
    "bf16-true": (2, 2),
    "32-true": (4, 4),
}
COMPUTE_DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""The dtype activations are recorded in, by its bytes (fp16 takes as many bytes as bf16)."""
ADAM_STATES_PER_PARAMETER = 2
"""exp_avg and exp_avg_sq, each the size of the parameter, in fp32 (litsft.training.optimizer)."""
PREFETCHED_BLOCKS = 2
"""Blocks whose unsharded parameters are alive at once when resharding after forward: the block being
computed and the next one, all-gathered ahead (FSDP2's implicit prefetch)."""
ACTIVATION_SCALE = 1.0
"""Calibration factor on the activation estimate (allocator rounding, saved tensors not counted below)."""
NF4_DEQUANTIZE_BYTES = 20
"""Bytes per weight torchao's NF4Tensor.get_original_weight holds at its peak while it dequantizes a weight
for `F.linear` (int64 codes, fp32 levels and scales, the fp32 result; measured on this CPU for a 4096 x 4096
weight: 20.1)."""
NF4_QUANTIZE_BYTES = 4 + 4 + 1 + (4 + 1) / NF4_BLOCK_SIZE
"""Bytes per weight that loading an NF4 weight holds at its peak besides the parameters
(litsft.model.precision.quantization.load_nf4_weight with torchao's NF4Tensor.from_tensor): the whole weight in fp32, its
values divided by their block's scale (fp32), a code byte per value before two are packed into one, and per
block of NF4_BLOCK_SIZE an fp32 scale and its int8 quantization."""
NF4_QUANTIZE_CHUNK_VALUES = 2**20
"""torchao finds each value's nearest NF4 level over chunks of this many values (its CHUNK_SIZE), holding the
fp32 distances of a chunk to all NF4_LEVELS levels twice (the difference and its absolute value): 128 MiB of
working memory, less for a smaller weight."""
NF4_LEVELS = 16
"""The values a 4-bit NF4 code stands for."""
USABLE_FRACTION = 0.9
"""Share of a device's memory that tensors can use; the rest goes to the CUDA context, NCCL buffers and
allocator fragmentation."""
RUNTIME_BYTES = 370 * 2**20
"""Host memory a training process holds before it has a model or data: Python with torch, Lightning and litsft's
training modules imported (the peak resident memory of a fresh process that imported them, torch 2.13.0+cpu:
370 MiB on the CPU of benchmarks/results/plan_vs_measured_small_cpu.txt). Not in a plan's per-device total: on a
CPU each process's peak is about the total plus this, on a GPU it stays in host memory."""
CUDA_CONTEXT_BYTES = 400 * 10**6
"""Device memory the CUDA context takes on each GPU a process uses, outside PyTorch's allocator and so outside
the total: about 400 MB with CUDA 11.7+ and lazy module loading (PyTorch's default), as a PyTorch maintainer put
it in https://github.com/pytorch/pytorch/issues/109888; not measured here. USABLE_FRACTION leaves room for it."""

MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
MEMORY_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at the peak of a training step."""

    parameters: int
    """Stored (master) parameters: the shard this device owns, or all of them when replicated."""
    gradients: int
    """Gradients of the trainable parameters, sharded like them."""
    optimizer_states: int
    """AdamW's two moments of the trainable parameters, sharded like them."""
    activations: int
    """Tensors the forward pass saves for the backward pass."""
    transients: int
    """All-gathered compute-dtype parameters, one chunk of logits, gradient-reduction buffers."""
    accumulating: bool = False
    """Whether gradients of earlier micro-batches are alive during a forward pass (accumulation steps > 1)."""
    whole_gradients: int = 0
    """Gradients of every trainable parameter, unsharded: what each device would hold between micro-batches
    if the gradients were reduced on the last micro-batch only (the engine reduces each one instead)."""
    loading: int = 0
    """What loading the weights holds besides the parameters, before any optimizer state exists: quantizing
    the largest NF4 weight (`nf4_loading_bytes`); 0 without --quantize."""
    checkpoint: int = 0
    """This device's share of a step checkpoint: the trainable parameters as stored and their optimizer
    states (LoRA's frozen base is not in it: it is loaded again). A background save (--train.async_save)
    keeps a copy of it in host memory while it writes."""
    whole_checkpoint: int = 0
    """A step checkpoint on disk, every device's share together (replicas are written once). Both leave out
    AdamW's step counts, a few bytes per parameter tensor."""

    @property
    def step(self) -> int:
        """The peak of a training step."""
        forward_backward = self.activations + self.transients
        if self.accumulating:
            step = self.gradients + forward_backward
        else:
            step = max(self.gradients, forward_backward)
        return self.parameters + self.optimizer_states + step

    @property
    def total(self) -> int:
        """The peak of the run: a training step's, or loading's when quantizing a weight takes more (QLoRA on
        a small model)."""
        return max(self.step, self.parameters + self.loading)

    def breakdown(self) -> dict[str, int]:
        """The byte counts by kind, in the order `litsft plan` prints them."""
        kinds = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer states": self.optimizer_states,
            "activations": self.activations,
            "transients": self.transients,
        }
        return kinds | ({"loading": self.loading} if self.loading else {})


def nf4_loading_bytes(weight_values: int) -> int:
    """Bytes that loading one NF4 weight of `weight_values` values holds at its peak besides the parameters:
    the weight in fp32 and what torchao's quantization works in (NF4_QUANTIZE_BYTES per value, plus
    distances to the NF4 levels for one chunk of values)."""
    chunk = min(weight_values, NF4_QUANTIZE_CHUNK_VALUES)
    return math.ceil(weight_values * NF4_QUANTIZE_BYTES + 2 * NF4_LEVELS * 4 * chunk)


def context_kv_heads(num_kv_heads: int, context: int) -> int:
    """The key/value heads a context group's all-to-all splits between its ranks: the model's own when the
    context size divides them, otherwise each repeated until there are lcm(heads, context), so that every rank
    gets whole heads (a query head's rank must hold the kv head it reads)."""
    return num_kv_heads if num_kv_heads % context == 0 else math.lcm(num_kv_heads, context)


def context_attention_bytes(config: Config, tokens: int, compute_bytes: int, context: int) -> tuple[int, int]:
    """(saved, transient) bytes that context parallelism adds on a rank holding `tokens` tokens (its 1/context
    of each row) around one attention layer.

    Each rank swaps its q, k, v, laid out (B, H, T/N, D), for (B, H/N, T, D) in an all-to-all, attends over
    the whole sequence with H/N heads and swaps the output back to (B, T/N, H, D): the whole-sequence tensors
    are as large as a rank's slice of every head, so what the kernel saves is what it saves without context
    parallelism, but for kv heads repeated to lcm(K, N) when N does not divide K: those extra heads are saved
    (`saved`, per layer). Transient, one layer at a time: q, k, v and the output in both layouts, the
    all-to-all's send and receive buffers (and in the backward pass their gradients, as large)."""
    if context == 1:
        return 0, 0
    kv_heads = context_kv_heads(config.num_kv_heads, context)
    per_head = tokens * config.head_dim * compute_bytes  # one head over a rank's tokens, or 1/N head-sequence
    saved = 2 * (kv_heads - config.num_kv_heads) * per_head  # the repeated k and v
    transient = 2 * (2 * config.num_heads + 2 * kv_heads) * per_head  # q, k, v, output; send and receive
    return saved, transient


def expert_dispatch_bytes(config: Config, tokens: int, compute_bytes: int, expert: int) -> int:
    """Transient bytes that expert parallelism adds on a rank holding `tokens` tokens around one MoE layer
    (litsft.model.network.expert_parallel): the rows it receives for its experts and the rows it sends back,
    each `hidden_size` wide in the compute dtype.

    Counted for balanced routing: each of the expert group's ranks sends this rank 1/expert of its tokens x k
    assignments, so it receives tokens x k rows, as many as it sends. The worst case, every token of the group
    routed to this rank's experts, is `expert` times that (the dispatch is dropless: no capacity factor caps
    it). The expert matmuls' own tensors are the activations a block saves without expert parallelism."""
    if expert == 1:
        return 0
    rows = tokens * config.experts_per_token
    return 2 * rows * config.hidden_size * compute_bytes


def root_parameters(config: Config) -> int:
    """Parameters outside the blocks: embeddings (and the untied output head) plus the final norm."""
    return model_sizes(config).root_parameters


def block_parameters(config: Config) -> int:
    """Parameters of the largest block: what FSDP gathers at once for one block."""
    return max(layer.parameters for layer in model_sizes(config).layers)


def block_activation_bytes_per_token(
    config: Config, compute_bytes: int, lora: LoRAConfig | None = None
) -> int:
    """Bytes one block saves for the backward pass per token: the tensors autograd saves in a forward pass of
    the model's largest block as built, recorded by litsft.model.accounting.sizes.block_saved_bytes_per_token with the
    activations in a dtype of `compute_bytes` bytes (so a new family's block is counted as it is built).

    Assumes a fused attention kernel (flash or memory-efficient: q, k, v, the output and a logsumexp per head
    and query are kept, no (T, T) matrix), and counts what autograd keeps: a frozen projection without an
    adapter keeps no input under LoRA, each adapter with dropout keeps its dropped input and the mask.
    """
    return block_saved_bytes_per_token(config, COMPUTE_DTYPES[compute_bytes], lora)


def adapter_parameters(config: Config, lora: LoRAConfig) -> int:
    """Trained parameters of `lora` on `config`: A and B of each adapted projection and the variant's own (DoRA's
    magnitude per output row), counted on the model built with them on the meta device."""
    return _adapter_sizes(
        json.dumps(asdict(config), sort_keys=True), json.dumps(asdict(lora), sort_keys=True)
    )[0]


def adapter_buffer_bytes(config: Config, lora: LoRAConfig) -> int:
    """Bytes of the untrained tensors a variant keeps beside its adapters (PiSSA's initial A and B), which
    every device holds whole (FSDP2 shards parameters, not buffers), fp32 like the adapters."""
    return _adapter_sizes(
        json.dumps(asdict(config), sort_keys=True), json.dumps(asdict(lora), sort_keys=True)
    )[1]


@lru_cache(maxsize=64)
def _adapter_sizes(config_json: str, lora_json: str) -> tuple[int, int]:
    with torch.device("meta"):
        model = apply_lora(
            Transformer(Config(**json.loads(config_json))), LoRAConfig(**json.loads(lora_json))
        )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * 4 for name, b in model.named_buffers() if base_weight_name(name) is None)
    return trained, buffers


def estimate_memory(
    config: Config,
    devices: int = 1,
    num_nodes: int = 1,
    sharding_strategy: ShardingStrategy = "FULL_SHARD",
    precision: Precision = "bf16-mixed",
    micro_batch_size: int = 1,
    max_seq_length: int = 2048,
    activation_checkpointing: bool = False,
    lora: LoRAConfig | None = None,
    accumulation_steps: int = 1,
    quantize: Quantization | None = None,
    context: int = 1,
    expert: int = 1,
) -> MemoryEstimate:
    """Per-device bytes of one training step with AdamW; see the module docstring for the model. `lora`:
    train adapters on its targets (`adapter_parameters` counts them) instead of every weight;
    `quantize`: store the adapted block projections in NF4 (QLoRA; LoRA only); `context`: split every row
    over this many ranks (`--parallel.context`, refused as training refuses it: litsft.training.layout);
    `expert`: split every MoE layer's experts over this many ranks (`--parallel.expert`, refused as training
    refuses it: `ParallelLayout.check_experts`), see `expert_dispatch_bytes`."""
    if precision not in PARAMETER_BYTES:
        raise LitsftError(
            f"precision {precision!r} is not supported; choose one of {', '.join(PARAMETER_BYTES)}"
        )
    stored, compute = PARAMETER_BYTES[precision]
    layout = ParallelLayout.of(devices, num_nodes, sharding_strategy, context, expert)
    layout.check_heads(config.num_heads, config.name)
    layout.check_experts(config.num_experts, config.name)
    shard = layout.shard_group_size

    targets = lora.target_list if lora is not None else []
    adapters = adapter_parameters(config, lora) if lora is not None else 0
    # lm_head's adapter sits in the root, which stays gathered; the blocks' adapters are gathered per block.
    head_adapter = (
        adapter_parameters(config, replace(lora, targets=["lm_head"])) if "lm_head" in targets else 0
    )
    adapters_per_block = (adapters - head_adapter) // config.num_layers
    trainable = adapters if lora is not None else num_parameters(config)
    # LoRA's frozen base is stored in the compute dtype (bf16 under bf16-mixed), its adapters like trained
    # parameters.
    frozen = num_parameters(config) if lora is not None else 0
    if quantize is not None and lora is None:
        raise LitsftError("--quantize nf4 applies to LoRA's frozen base: pass --lora.rank (finetune_lora)")
    # The NF4 weights: every adapted projection of every block, and of the largest block.
    layers = model_sizes(config).layers
    quantized_linears = [
        fan_in * fan_out for layer in layers for target, (fan_in, fan_out) in layer.linear.items() if target in targets
    ] if quantize is not None else []  # fmt: skip
    quantized = sum(quantized_linears)
    quantized_per_block = quantized // config.num_layers
    unquantized_bytes_per_nf4 = compute - NF4_BYTES_PER_WEIGHT  # what NF4 saves on each weight it stores
    parameters = math.ceil(
        ((num_parameters(config) - frozen) * stored + frozen * compute + adapters * stored
         - quantized * unquantized_bytes_per_nf4) / shard
    ) + (adapter_buffer_bytes(config, lora) if lora is not None else 0)  # fmt: skip
    gradients = math.ceil(trainable * stored / shard)
    # Weights stored in fewer than 4 bytes also keep a compensation buffer of their own dtype (litsft.training.optimizer).
    state_bytes = 4 * ADAM_STATES_PER_PARAMETER + (stored if stored < 4 else 0)
    optimizer_states = math.ceil(trainable * state_bytes / shard)
    whole_checkpoint = trainable * (stored + state_bytes)

    # A context rank holds 1/context of a micro-batch's tokens: its rows joined into one, padded to a multiple
    # of the context size (litsft.model.network.batch.split_for_context).
    whole_tokens = micro_batch_size * max_seq_length
    tokens = -(-whole_tokens // context)
    context_saved, context_transient = context_attention_bytes(config, tokens, compute, context)
    per_block = block_activation_bytes_per_token(config, compute, lora) * tokens + context_saved
    if activation_checkpointing:
        # Each block keeps only its input; one block's activations come back during its recomputation.
        blocks = config.num_layers * tokens * config.hidden_size * compute + per_block
    else:
        blocks = config.num_layers * per_block
    # Outside the blocks: the final norm (fp32 upcast + output) on a rank's tokens, and RoPE's cos and sin,
    # which every context rank makes for the whole row (LongRoPE picks its factors by whole lengths).
    head = tokens * config.hidden_size * (4 + compute) + whole_tokens * 2 * config.head_dim * compute
    activations = math.ceil((blocks + head) * ACTIVATION_SCALE)

    # Expert parallelism keeps the resting shards (efsdp x expert = the shard group), but a block's experts are
    # all-gathered over efsdp only: a rank gathers its expert group share, E/expert experts, not all E.
    block_size = block_parameters(config) + adapters_per_block
    block_size -= max(layer.expert_weights for layer in layers) * (expert - 1) // expert
    if not layout.sharded:
        # No FSDP: Fabric's autocast casts every fp32 weight for its matmul and the cast copies are kept for
        # the backward pass; with one dtype the parameters are used as they are (LoRA's frozen base too).
        gathered = ((num_parameters(config) - frozen) + adapters) * compute if stored != compute else 0
        reduce_buffers = 0
        gathered_nf4_savings = 0
    else:
        # The root is never resharded (litsft/training/parallel.py), SHARD_GRAD_OP keeps every block unsharded
        # from its forward to its backward, the other strategies hold PREFETCHED_BLOCKS at a time.
        held = (
            config.num_layers
            if sharding_strategy == "SHARD_GRAD_OP"
            else min(PREFETCHED_BLOCKS, config.num_layers)
        )
        gathered = (held * block_size + root_parameters(config) + head_adapter) * compute
        # NF4 weights are gathered in 4 bits; with shards of one rank FSDP leaves them alone (parallel.py).
        gathered_nf4_savings = (
            held * quantized_per_block * (compute if shard == 1 else unquantized_bytes_per_nf4)
        )
        # One block's unsharded gradients (compute dtype) and their copy in the reduce dtype. The root's
        # gradients are reduced at the very end of backward, when the activations are gone.
        reduce_buffers = (adapters_per_block if lora is not None else block_size) * (compute + stored)
    # One chunk of the loss's logits (litsft.model.network.loss sizes the chunks), recomputed in the backward pass.
    loss_chunk = loss_chunk_tokens(config.vocab_size, COMPUTE_DTYPES[compute])
    logits = min(loss_chunk, tokens) * config.vocab_size * (compute + FP32_BYTES_PER_LOGIT)
    dequantized = max(quantized_linears, default=0) * NF4_DEQUANTIZE_BYTES
    transients = math.ceil(gathered - gathered_nf4_savings) + reduce_buffers + logits + dequantized
    transients += context_transient + expert_dispatch_bytes(config, tokens, compute, expert)
    # Each rank quantizes every NF4 weight whole, one at a time (litsft.model.precision.quantization.load_nf4_weight).
    loading = nf4_loading_bytes(max(quantized_linears)) if quantized_linears else 0
    return MemoryEstimate(
        parameters, gradients, optimizer_states, activations, transients,
        accumulating=accumulation_steps > 1, whole_gradients=trainable * stored, loading=loading,
        checkpoint=math.ceil(whole_checkpoint / shard), whole_checkpoint=whole_checkpoint,
    )  # fmt: skip


def accumulation_summary(estimate: MemoryEstimate, sharding_strategy: ShardingStrategy, steps: int) -> str:
    """One line on how gradients are reduced while accumulating over `steps` micro-batches, and what that
    leaves on each device (litsft.training.parallel.synchronize_gradients decides it per strategy)."""
    whole = estimate.whole_gradients / 2**30
    if sharding_strategy == "NO_SHARD":
        return (
            f"gradient accumulation over {steps} micro-batches: gradients all-reduced after the last one "
            f"(NO_SHARD holds them whole anyway: {whole:.2f} GiB)"
        )
    reduction = (
        "reduce-scattered within the node after each one and all-reduced across nodes after the last"
        if sharding_strategy == "HYBRID_SHARD"
        else "reduce-scattered after each one"
    )
    return (
        f"gradient accumulation over {steps} micro-batches: gradients {reduction}, so they stay sharded "
        f"({estimate.gradients / 2**30:.2f} GiB; held whole until the last one they would take {whole:.2f} GiB)"
    )


def parse_memory_size(text: str) -> int:
    """Bytes in "80GB" (10^9), "80GiB" (2^30), "24 GB", "512MiB"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", text, flags=re.IGNORECASE)
    if match is None or match.group(2).upper() not in MEMORY_UNITS:
        raise LitsftError(f"device_memory {text!r} is not a memory size; write it like 80GB or 80GiB")
    return int(float(match.group(1)) * MEMORY_UNITS[match.group(2).upper()])


def fits(estimate: MemoryEstimate, device_memory: int) -> bool:
    return estimate.total <= device_memory * USABLE_FRACTION


def load_model_config(checkpoint_dir: str) -> Config:
    """The model a recipe's checkpoint_dir names: a litsft checkpoint directory, or else the named config of its
    last part (Llama-3.1-8B, meta-llama/Llama-3.1-8B or checkpoints/meta-llama/Llama-3.1-8B before the
    recipe has downloaded it)."""
    if is_step_checkpoint(Path(checkpoint_dir)):
        return step_model_config(Path(checkpoint_dir))
    if Path(checkpoint_dir).is_dir():
        return Config.from_checkpoint(checkpoint_dir)
    return Config.from_name(Path(checkpoint_dir).name)


def plan(
    checkpoint_dir: str,
    devices: int = 1,
    num_nodes: int = 1,
    precision: Precision | None = None,
    lora: LoRAConfig | None = None,
    quantize: Quantization | None = None,
    fsdp: FSDPConfig = FSDPConfig(),
    parallel: ParallelConfig = ParallelConfig(),
    train: TrainConfig | None = None,
    device_memory: str | None = None,
    out_dir: Path | None = None,
    data: Any = None,
    accelerator: Accelerator = "auto",
    resume: Any = "auto",
    seed: int = 1337,
    eval: EvalConfig | None = None,
    optimizer: OptimizerConfig | None = None,
    log: LogConfig | None = None,
    objective: ObjectiveConfig | None = None,
) -> None:
    """Estimate the memory per device of a training run, and whether it fits; and what a step checkpoint
    takes on disk and in a node's host memory while written in the background.

    Takes a recipe's options (and its YAML: `litsft plan --config config_hub/finetune_lora/llama-3.1-8b.yaml`).

    Args:
        checkpoint_dir: The model: a named config (`litsft list_models`), a hub id or a litsft checkpoint
            directory.
        devices: Devices (GPUs) per node.
        num_nodes: Number of nodes.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true, as in training (default: bf16-mixed, what a
            recipe picks on a GPU with bf16).
        lora: Plan finetune_lora: train adapters on these targets (default all-linear), the frozen base
            stored in the compute dtype. Without it, finetune_full (every parameter trained).
        quantize: nf4 plans finetune_lora --quantize nf4 (QLoRA): the adapted block projections in 4 bits.
        fsdp: Sharding strategy and activation checkpointing, as in training (cpu_offload is not modelled).
        parallel: Context and expert parallelism, as in training: --parallel.context N splits every row
            over N ranks of a node, which read the same micro-batches; --parallel.expert N splits every MoE
            layer's experts over N ranks of a shard group (the dispatch buffers counted for balanced routing).
        train: Micro batch size, global batch size and sequence length, as in training. Default: one row of
            the model's context length (at most 2048 tokens) per device and step, no gradient accumulation.
        device_memory: Memory of one device, e.g. 80GB or 80GiB, for a fits / does not fit verdict.
        out_dir: Read from a recipe's YAML and not used: it does not change the memory a step needs.
        data: Not used, as out_dir.
        accelerator: Not used, as out_dir.
        resume: Not used, as out_dir.
        seed: Not used, as out_dir.
        eval: Not used, as out_dir.
        optimizer: Not used, as out_dir (AdamW's two states are always counted).
        log: Not used, as out_dir.
        objective: A preference objective (--objective.name dpo, ...) on unpacked data (--data.packing false)
            puts each pair in two rows, so a micro-batch of pairs is planned as twice its rows, each as long
            as the longest (at most max_seq_length); packed, a row holds its pairs' sequences as documents.
            Its reference adds nothing to a step's peak: precomputed, it is scored before training; live, its
            no-grad forward pass frees its activations before the step's own forward pass.
    """
    for name, value in (("devices", devices), ("num_nodes", num_nodes)):
        if value < 1:
            raise LitsftError(f"--{name} must be at least 1, got {value}")
    memory = parse_memory_size(device_memory) if device_memory is not None else None
    config = load_model_config(checkpoint_dir)
    layout = ParallelLayout.of(devices, num_nodes, fsdp.sharding_strategy, parallel.context, parallel.expert)
    layout.check_heads(config.num_heads, config.name)
    layout.check_experts(config.num_experts, config.name)
    micro_batch_size = train.micro_batch_size if train is not None else 1
    pairs = objective is not None and objective.pairs
    packed = _packing(data)
    if pairs and not packed:
        micro_batch_size *= 2  # a pair's chosen and rejected sequences are two rows
    max_seq_length = (train.max_seq_length if train is not None else None) or min(
        config.max_position_embeddings, MAX_DEFAULT_SEQ_LENGTH
    )
    precision = precision or "bf16-mixed"
    accumulation = step_geometry(train, layout.data_replicas).accumulation_steps if train is not None else 1
    estimate = estimate_memory(
        config, devices, num_nodes, fsdp.sharding_strategy, precision, micro_batch_size, max_seq_length,
        fsdp.activation_checkpointing, lora, accumulation, quantize, parallel.context, parallel.expert,
    )  # fmt: skip
    sizes = model_sizes(config)
    # An MoE block has no gate, up or down projection: all-linear adapts what it has, and naming the
    # experts (or gate, up, down) adapts the fused experts.
    targets = [t for t in lora.target_list if t == "lm_head" or t in sizes.layers[0].linear] if lora else []
    if lora is not None and config.num_experts and lora.targets != "all-linear":
        targets += ["experts"] if set(EXPERT_TARGETS) & set(lora.target_list) else []
    method = f"LoRA rank {lora.rank} on {', '.join(targets)}" if lora is not None else "full fine-tuning"
    if quantize is not None:
        method = f"Q{method}, base in {quantize.upper()}"
    active = sizes.active_parameters
    counted = format_count(sizes.parameters) + (
        f", {format_count(active)} active" if active < sizes.parameters else ""
    )
    print(f"{config.name} ({counted} parameters), {method}, {precision}")
    note = precision_note(precision, local_gpu(), layout.world_size)
    if note:
        print(note)
    print(f"{devices} device(s) x {num_nodes} node(s): {layout.describe()}")
    checkpointing = "with" if fsdp.activation_checkpointing else "without"
    row = f"{max_seq_length} tokens"
    if layout.context > 1:
        row += f" ({-(-micro_batch_size * max_seq_length // layout.context)} a micro-batch on each rank of a context group)"
    print(f"micro batch {micro_batch_size} x {row}, {checkpointing} activation checkpointing")
    if pairs:
        rows = "rows of pairs' sequences" if packed else "rows: each pair's chosen and rejected sequences"
        reference = {"precomputed": "scored once before training", "live": "a no-grad pass per micro-batch"}
        needed = objective.name in ("dpo", "ipo")
        print(
            f"objective {objective.name}: {rows}; reference "
            + (f"{reference[objective.reference]}, not above the step's peak" if needed else "none")
        )
    if layout.expert > 1:
        print(
            f"expert parallelism: each rank computes {config.num_experts // layout.expert} of every MoE layer's "
            f"{config.num_experts} experts; the dispatch buffers are counted for balanced routing (skewed routing "
            f"can send one rank up to {layout.expert}x the rows)"
        )
    if accumulation > 1 and layout.sharded:
        print(accumulation_summary(estimate, fsdp.sharding_strategy, accumulation))
    print(checkpoint_summary(estimate, devices))
    print_estimate(estimate, memory, device_memory)


def checkpoint_summary(estimate: MemoryEstimate, devices: int) -> str:
    """One line on a step checkpoint's size on disk and the host memory a background save keeps on a node
    (what `litsft.training.checkpointer.background_saves_fit` checks at the first save)."""
    per_node = estimate.checkpoint * devices
    return (
        f"step checkpoint: {estimate.whole_checkpoint / 2**30:.2f} GiB on disk; a background save "
        f"(--train.async_save) keeps {per_node / 2**30:.2f} GiB of host memory per node ({devices} x "
        f"{estimate.checkpoint / 2**30:.2f} GiB) until it is written"
    )


def local_gpu() -> tuple[str, bool] | None:
    """(name, whether it computes in bf16) of this machine's GPU, the card a plan made here is most likely for;
    None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(), gpu_has_bf16()


def precision_note(precision: Precision, gpu: tuple[str, bool] | None, world_size: int) -> str | None:
    """A line on what the GPU here (`local_gpu`) does with `precision` when it has no bf16 (V100, T4): training
    refuses bf16 there, and 16-mixed is its mixed precision, on one GPU only (`check_fsdp_options`)."""
    if gpu is None or gpu[1]:
        return None
    name = gpu[0]
    if precision.startswith("bf16"):
        return (
            f"note: this machine's GPU ({name}) has no bf16, so training refuses --precision {precision} on it; "
            "plan --precision 16-mixed (one GPU) or 32-true for it"
        )
    if precision == "16-mixed":
        several = " (training refuses it on several GPUs: FSDP2 here takes no fp16)" if world_size > 1 else ""
        return f"note: this machine's GPU ({name}) has no bf16: 16-mixed (fp16 with loss scaling) is its mixed precision{several}"
    return None


def runtime_summary(estimate: MemoryEstimate) -> str:
    """The lines under the total on what each process holds besides it: the runtime (RUNTIME_BYTES), and on a
    GPU the CUDA context (CUDA_CONTEXT_BYTES). For a small model they are most of the process."""
    process = (estimate.total + RUNTIME_BYTES) / 2**30
    return (
        f"{'runtime':<18}{RUNTIME_BYTES / 2**30:>9.2f}  per process, not in the total: Python, torch and Lightning "
        "(measured on a CPU)\n"
        f"A CPU process peaks near total + runtime = {process:.2f} GiB. On a GPU the runtime is host memory, and the "
        f"CUDA context takes about {CUDA_CONTEXT_BYTES / 2**30:.2f} GiB more of each device (PyTorch's figure, "
        "not measured here)."
    )


def print_estimate(estimate: MemoryEstimate, memory: int | None, device_memory: str | None) -> None:
    """The breakdown table and, given a device memory, the verdict."""
    peak = (
        "gradients + activations + transients"
        if estimate.accumulating
        else "max(gradients, activations + transients)"
    )
    step = f"parameters + optimizer states + {peak}"
    print(f"total = max({step}, parameters + loading)" if estimate.loading else f"total = {step}")
    print()
    print(f"{'per device':<18}{'GiB':>9}")
    for name, size in estimate.breakdown().items():
        print(f"{name:<18}{size / 2**30:>9.2f}")
    print(f"{'total':<18}{estimate.total / 2**30:>9.2f}")
    print(runtime_summary(estimate))
    if memory is None:
        print("\nPass --device_memory (e.g. 80GB) for a verdict.")
        return
    verdict = "fits" if fits(estimate, memory) else "does not fit"
    print(
        f"\n{verdict}: {estimate.total / 2**30:.2f} GiB needed, {memory * USABLE_FRACTION / 2**30:.2f} GiB usable "
        f"of {device_memory} ({USABLE_FRACTION:.0%})"
    )


def _packing(data: Any) -> bool:
    """Whether a recipe's --data packs rows (its YAML's init_args, or a data module), True when unknown."""
    if isinstance(data, dict):
        data = data.get("init_args", data)
        return bool(data.get("packing", True))
    return bool(getattr(data, "packing", True))
