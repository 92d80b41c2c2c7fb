"""Mixture-of-experts MLP (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral): a router that picks `k` of `E` SwiGLU experts per
token, the experts as two fused 3D weights, computed dropless, Qwen2-MoE's gated shared expert beside them, and the
load-balancing loss over the routing.

Shapes in comments: N tokens, C hidden size, E experts, k experts per token, I an expert's intermediate size,
A = N * k (token, expert) assignments, L MoE layers.

Layout: `gate_up_proj` (E, 2I, C), each expert's gate rows then its up rows, and `down_proj` (E, C, I): the
layout transformers 5 builds in memory from the hub's per-expert tensors (`MergeModulelist` then
`Concatenate` in transformers' conversion_mapping.py), so each expert's slice is an `F.linear` weight and
conversion is a stack. One parameter per projection also means every rank computes a gradient for every
expert (zero for the experts it routed nothing to), so FSDP2's reduce-scatter never waits on a rank that
skipped one, and FSDP2 shards both along the expert dimension (dim 0).

Dropless: every assignment is computed, none is dropped for capacity. The assignments are sorted by expert so
that each expert's tokens are one contiguous slice: on CUDA in bf16 both projections are one
`torch._grouped_mm` each over those slices; elsewhere (CPU, fp32) each expert with tokens runs one matmul over
its slice, exact and without padding.

LoRA on the experts (litsft.model.lora.layers.ExpertLoRA, when `--lora.targets` names them) gives a projection
per-expert A (E, r, in) and B (E, out, r), set here as `gate_up_lora` / `down_lora`; each assignment adds
(x A_e^T) B_e^T * scaling through the same sorted slices and kernels as its expert's base weight, so no
per-expert delta B_e A_e (E, out, in) is ever built.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce

from litsft.model.config import Config
from litsft.model.network.expert_parallel import ExpertShard, combine, dispatch, local_experts
from litsft.model.network.mlp import MLP, gated_activation


@dataclass(frozen=True)
class Routing:
    """What one MoE layer's router did in the last forward pass, per sequence (each packed document, or each
    row), for the load-balancing loss and the logs."""

    expert_tokens: torch.Tensor
    """(S, E) fp32: the assignments each expert received from each sequence's tokens (k per token)."""
    probability_sums: torch.Tensor
    """(S, E) fp32: each expert's router probability summed over each sequence's tokens; carries the
    router's gradient."""
    tokens: torch.Tensor
    """(S,) fp32: each sequence's tokens."""


def route(
    logits: torch.Tensor,
    experts_per_token: int,
    normalize: bool,
    bias: torch.Tensor | None = None,
    over_top_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router of OLMoE, Qwen3-MoE and Mixtral (transformers' *TopKRouter): softmax over all E experts in
    fp32, then the top k; with `normalize` (Mixtral always, the others when `norm_topk_prob`) the k
    probabilities are rescaled to sum to 1. Mixtral's original "top-k logits, then softmax over them" is the
    same thing. `over_top_k` (gpt-oss): the top k logits, then a softmax over them alone, in fp32, picked by
    logit as transformers' GptOssTopKRouter picks (the probabilities, for the balancing loss, stay over all E).
    logits (N, E) -> (weights (N, k) fp32, experts (N, k), probabilities (N, E) fp32).

    `bias` (E,): DeepSeek-V3's balancing bias (arXiv:2412.19437 eq. 16), added to the probabilities for the
    choice of the k experts only; their weights stay what the router gives them."""
    probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    if over_top_k:
        choice = logits if bias is None else probabilities + bias
        experts = torch.topk(choice, experts_per_token, dim=-1).indices  # (N, k)
        return torch.softmax(logits.gather(-1, experts), dim=-1, dtype=torch.float32), experts, probabilities
    if bias is None:
        weights, experts = torch.topk(probabilities, experts_per_token, dim=-1)  # (N, k)
    else:
        experts = torch.topk(probabilities + bias, experts_per_token, dim=-1).indices  # (N, k)
        weights = probabilities.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probabilities


def load_balancing_loss(
    routings: Iterable[Routing], num_experts: int, context_group: Any = None
) -> torch.Tensor:
    """Each sequence's auxiliary load-balancing loss (S,), that of Switch Transformer
    (https://arxiv.org/abs/2101.03961, eq. 4-6) as transformers' `load_balancing_loss_func` computes it for
    these families: E * sum_e f_e * P_e, where f_e is expert e's share of the assignments and P_e its mean
    router probability, both pooled over every layer (a token counted once per layer). Only P carries a
    gradient. k for perfectly even routing.

    transformers pools the whole batch of a forward pass; litsft pools each sequence (each packed document,
    each unpacked row), as DeepSeek-V3's sequence-wise balance loss does (https://arxiv.org/abs/2412.19437,
    eq. 17-20): a sum over sequences does not depend on which micro-batch or rank a sequence lands in, so
    accumulation and N processes train exactly as one process. For one sequence it is transformers' value.

    `context_group`: the process group of a context group (context parallelism), whose ranks each hold a slice
    of every sequence: the counts and probability sums are summed over it first, by an all-reduce whose backward
    sums the ranks' gradients, so that every rank has each whole sequence's loss."""
    routings = list(routings)
    tokens = len(routings) * routings[0].tokens  # (S,)
    assigned = torch.stack([routing.expert_tokens for routing in routings]).sum(0)  # (S, E)
    probability = torch.stack([routing.probability_sums for routing in routings]).sum(0)  # (S, E)
    if context_group is not None:
        E = assigned.shape[1]
        whole = all_reduce(torch.cat([assigned, probability, tokens[:, None]], dim=1), group=context_group)
        assigned, probability, tokens = whole[:, :E], whole[:, E : 2 * E], whole[:, 2 * E]
    rows = tokens.clamp(min=1)[:, None]  # (S, 1)
    return num_experts * ((assigned / rows) * (probability / rows)).sum(-1)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation, (..., I) each -> (..., I): the gate clamped to at most `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts._apply_gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two fused weights: gate and up (E, 2I, C), down (E, C, I); with `bias`, a bias for
    each (E, 2I) and (E, C); `activation` "clamped_swiglu" is gpt-oss's (`clamped_swiglu`, its `alpha` and
    `limit`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: Literal["silu", "clamped_swiglu"] = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = (
            nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        )
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.activation, self.alpha, self.limit = activation, alpha, limit
        # Per-expert low-rank adapters on each projection (litsft.model.lora.layers.ExpertLoRA): modules with
        # `lora_A.weight` (E, r, in), `lora_B.weight` (E, out, r) and `scaling`, or None.
        self.gate_up_lora: nn.Module | None = None
        self.down_lora: nn.Module | None = None
        self.adapters_enabled = (
            True  # False: the experts without their adapters (lora.layers.adapters_disabled)
        )
        # Expert parallelism (litsft.model.network.expert_parallel): this rank's place in its expert group, its
        # weights and adapters then DTensors sharded over that group along dim 0 (its experts' rows local).
        self.expert_shard: ExpertShard | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Each expert as nn.Linear would initialize its weight (kaiming-uniform over its fan-in).
        for weight in (self.gate_up_proj, self.down_proj):
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def activate(self, hidden: torch.Tensor) -> torch.Tensor:
        """An expert's gate and up halves (..., 2I) -> its activation (..., I)."""
        gate, up = hidden.chunk(2, dim=-1)
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(gate, up, self.alpha, self.limit)
        return gated_activation(gate, up)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x (N, C), each token's k experts (N, k), their weights (N, k) and each expert's assignments (E,) ->
        (N, C): for each token, the sum over its k experts of weight * down(silu(gate(x)) * up(x))."""
        k = experts.shape[1]
        order = experts.flatten().argsort(stable=True)  # assignments grouped by expert, in token order
        token_of = order // k  # (A,) the token of each sorted assignment
        sorted_x = x[token_of]  # (A, C)
        rows, row_counts = sorted_x, counts
        if self.expert_shard is not None:  # the rows of this rank's experts, from every rank of its group
            rows, row_counts, exchange = dispatch(sorted_x, counts, self.expert_shard)
        if uses_grouped_mm(rows, self):
            out = self._grouped(rows, row_counts)
        else:
            out = self._per_expert(rows, row_counts)
        if self.expert_shard is not None:
            out = combine(out, exchange, self.expert_shard)  # (A, C)
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x, dtype=out.dtype).index_add_(0, token_of, out).to(x.dtype)

    def _grouped(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # torch._grouped_mm(a (A, K), b (E, K, M), offs) multiplies each expert's rows of a by its b: the
        # weights go in transposed, as views. It is not autocast-aware, so inputs are cast to the weights'
        # compute dtype (bf16) here.
        offsets = counts.cumsum(0, dtype=torch.int32)  # (E,) end of each expert's slice
        dtype = compute_dtype(self.gate_up_proj)
        gate_up = local_experts(self.gate_up_proj).to(dtype).transpose(-2, -1)  # (E, C, 2I)
        down = local_experts(self.down_proj).to(dtype).transpose(-2, -1)  # (E, I, C)
        sorted_x = sorted_x.to(dtype)
        hidden = torch._grouped_mm(sorted_x, gate_up, offs=offsets)  # (A, 2I)
        if self.gate_up_proj_bias is not None:  # then down_proj_bias too (`bias`)
            # Each sorted assignment's expert; output_size keeps the host from waiting for the counts.
            experts = torch.arange(counts.shape[0], device=counts.device)
            sorted_experts = experts.repeat_interleave(counts, output_size=sorted_x.shape[0])  # (A,)
            hidden = hidden + local_experts(self.gate_up_proj_bias).to(dtype)[sorted_experts]
        if self.gate_up_lora is not None and self.adapters_enabled:
            hidden = hidden + _grouped_low_rank(self.gate_up_lora, sorted_x, offsets, dtype)
        activated = self.activate(hidden)  # (A, I)
        out = torch._grouped_mm(activated, down, offs=offsets)  # (A, C)
        if self.down_proj_bias is not None:
            out = out + local_experts(self.down_proj_bias).to(dtype)[sorted_experts]
        if self.down_lora is not None and self.adapters_enabled:
            out = out + _grouped_low_rank(self.down_lora, activated, offsets, dtype)
        return out

    def _per_expert(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # One matmul per expert over its contiguous slice. The counts are read on the host: free on a CPU,
        # and the price of this path on a GPU (where the grouped path is the one that runs in bf16).
        # unbind, not gate_up_proj[e]: the backward of one unbind stacks the experts' gradients into one
        # (E, 2I, C) tensor, where each indexing adds a zero-filled full-size gradient of its own (64 per
        # projection for OLMoE: 36x slower at 128 tokens, forward and backward; benchmarks/bench_moe_cpu.py).
        gate_ups, downs = local_experts(self.gate_up_proj).unbind(0), local_experts(self.down_proj).unbind(0)
        no_bias = (None,) * len(gate_ups)
        gate_up_biases, down_biases = (
            local_experts(bias).unbind(0) if bias is not None else no_bias
            for bias in (self.gate_up_proj_bias, self.down_proj_bias)
        )
        gate_up_lora, down_lora = (
            _per_expert_adapters(adapter if self.adapters_enabled else None)
            for adapter in (self.gate_up_lora, self.down_lora)
        )
        outputs = []
        slices = sorted_x.split(slice_sizes(counts, sorted_x.shape[0]))
        # The experts with rows; with none (an expert-parallel rank that received nothing), the first over its
        # empty slice, so that the weights still get their (zero) gradient and the backward reaches the input.
        computed = [expert for expert, rows in enumerate(slices) if rows.shape[0]] or [0]
        for expert in computed:
            rows = slices[expert]
            hidden = F.linear(rows, gate_ups[expert], gate_up_biases[expert])  # (n_e, 2I)
            if gate_up_lora is not None:
                hidden = hidden + _low_rank(gate_up_lora, expert, rows)
            activated = self.activate(hidden)  # (n_e, I)
            out = F.linear(activated, downs[expert], down_biases[expert])  # (n_e, C)
            if down_lora is not None:
                out = out + _low_rank(down_lora, expert, activated)
            outputs.append(out)
        return torch.cat(outputs)


def _per_expert_adapters(
    adapter: nn.Module | None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], float] | None:
    """An expert adapter's A and B, each unbound into its E experts' slices (one gradient for all of them, as
    for the base weights), and its scaling; None without an adapter."""
    if adapter is None:
        return None
    lora_A, lora_B = (local_experts(weight) for weight in (adapter.lora_A.weight, adapter.lora_B.weight))
    return lora_A.unbind(0), lora_B.unbind(0), adapter.scaling


def _low_rank(
    adapter: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], float], expert: int, rows: torch.Tensor
) -> torch.Tensor:
    """(rows A_e^T * scaling) B_e^T for one expert's rows (n_e, in) -> (n_e, out): rank-wide intermediates only."""
    lora_A, lora_B, scaling = adapter
    return F.linear(F.linear(rows, lora_A[expert]) * scaling, lora_B[expert])


def _grouped_low_rank(
    adapter: nn.Module, sorted_rows: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The adapter's term for every sorted assignment (A, in) -> (A, out), as two grouped matmuls."""
    lora_A = local_experts(adapter.lora_A.weight).to(dtype).transpose(-2, -1)  # (E, in, r)
    lora_B = local_experts(adapter.lora_B.weight).to(dtype).transpose(-2, -1)  # (E, r, out)
    narrow = torch._grouped_mm(sorted_rows, lora_A, offs=offsets) * adapter.scaling  # (A, r)
    return torch._grouped_mm(narrow.to(dtype), lora_B, offs=offsets)


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the experts multiply in: autocast's when it is on (one process under bf16-mixed), else the
    weight's (FSDP2 casts it to bf16 for the forward pass under bf16-mixed)."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def uses_grouped_mm(x: torch.Tensor, experts: GroupedExperts) -> bool:
    """Whether the experts run as `torch._grouped_mm`: on CUDA in bf16 where the kernel exists (torch 2.9+
    on SM80+, Hopper only before; transformers' `_can_use_grouped_mm` in integrations/moe.py keeps the same
    table) and every row it reads is 16-byte aligned, as the kernel needs (C, I and a LoRA rank multiples of 8)."""
    weight = experts.gate_up_proj
    if (
        x.device.type != "cuda"
        or compute_dtype(weight) != torch.bfloat16
        or not hasattr(torch, "_grouped_mm")
    ):
        return False
    sizes = [weight.shape[-1], experts.down_proj.shape[-1]]
    sizes += [
        adapter.lora_A.weight.shape[1]
        for adapter in (experts.gate_up_lora, experts.down_lora)
        if adapter is not None
    ]
    aligned = all(size % 8 == 0 for size in sizes)
    return aligned and torch.cuda.get_device_capability(x.device) >= (8, 0)


def slice_sizes(counts: torch.Tensor, assignments: int) -> list[int]:
    """Each expert's assignments as host ints. A tensor without data (the meta device, the fake tensors that
    litsft.model.accounting.sizes records activations on) has no routing to read: the assignments are then split evenly,
    which changes no count that grows with the tokens, as every expert's work does."""
    if counts.device.type != "meta" and not isinstance(counts, torch._subclasses.fake_tensor.FakeTensor):
        return counts.tolist()
    experts = counts.shape[0]
    return [assignments // experts + (e < assignments % experts) for e in range(experts)]


def expert_load(model: nn.Module) -> torch.Tensor | None:
    """The assignments each expert of each MoE layer of `model` (or of a wrapper around it) received in its
    last forward pass, (L, E), detached; None for a dense model."""
    routings = [module.routing for module in model.modules() if isinstance(module, MoE)]
    if not routings or any(routing is None for routing in routings):
        return None
    return torch.stack([routing.expert_tokens.sum(0) for routing in routings]).detach()  # type: ignore[union-attr]


@torch.no_grad()
def reset_balancing_biases(model: nn.Module) -> None:
    """Zero every MoE layer's `balancing_bias`: its value before any balancing, for a model materialized from the
    meta device (whose buffers hold whatever memory they got) before a checkpoint that has them is loaded."""
    for module in model.modules():
        if isinstance(module, MoE) and module.balancing_bias is not None:
            module.balancing_bias.zero_()


@torch.no_grad()
def update_balancing_bias(model: nn.Module, expert_tokens: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing update (arXiv:2412.19437 section 2.1.2), after an optimizer
    step: each MoE layer's `balancing_bias` += rate x sign(mean load - load), from the assignments each expert
    received over the whole step (L, E), summed over every rank, so every rank moves its copy the same."""
    layers = [
        module for module in model.modules() if isinstance(module, MoE) and module.balancing_bias is not None
    ]
    for layer, load in zip(layers, expert_tokens.to(torch.float32)):
        layer.balancing_bias += rate * torch.sign(load.mean() - load)


class MoE(nn.Module):
    """The MLP of an MoE block: route each token (N, C) to k of E experts and sum their weighted outputs.
    After each forward pass `routing` holds what the router did for each sequence (`Routing`); the model
    sets `sequences` before it, the sequence of each token (litsft.model.network.transformer.Transformer)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.experts_per_token = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.over_top_k = config.router_softmax == "top_k"
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = GroupedExperts(
            config.num_experts,
            config.hidden_size,
            config.expert_intermediate,
            bias=config.expert_bias,
            activation=config.expert_activation,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
        )
        # Qwen2-MoE's shared expert: a dense MLP every token runs, scaled by its own sigmoid gate (Linear(C, 1)).
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(config, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        self.sequences: tuple[torch.Tensor, int] | None = None
        """(the sequence of each token (N,), the number of sequences S), where the id S marks padding, which
        `routing` leaves out (it still runs through the experts: its outputs reach no real token, and
        leaving it out of them would give the experts a batch whose size only the data knows); None: all
        tokens one sequence."""
        self.routing: Routing | None = None
        # (E,) DeepSeek-V3's balancing bias (`route`, `update_balancing_bias`): a buffer, saved with the weights
        # and moved after each optimizer step, not by it; None without router_bias_update_rate.
        bias = torch.zeros(config.num_experts) if config.router_bias_update_rate else None
        self.register_buffer("balancing_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        weights, experts, probabilities = route(
            self.router(flat),
            self.experts_per_token,
            self.normalize,
            self.balancing_bias,
            over_top_k=self.over_top_k,
        )
        E = probabilities.shape[-1]
        flat_experts = experts.flatten()  # (A,)
        # A bincount of fixed length, so that its shape never depends on the data (meta and fake tensors).
        counts = torch.zeros(E, dtype=torch.int64, device=x.device)
        counts = counts.index_add_(0, flat_experts, torch.ones_like(flat_experts))  # (E,)
        self.routing = self._routing_per_sequence(experts, probabilities)
        out = self.experts(flat, experts, weights, counts)  # (N, C)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(flat))  # (N, 1)
            out = out + gate * self.shared_expert(flat)
        return out.view(B, T, C)

    def _routing_per_sequence(self, experts: torch.Tensor, probabilities: torch.Tensor) -> Routing:
        N, E = probabilities.shape
        device = probabilities.device
        ones = torch.ones(experts.numel(), device=device)
        if self.sequences is None or self.sequences[0].numel() != N:  # one sequence, no padding
            # A plain sum keeps nothing for its backward; index_add keeps the (N,) sequence ids.
            expert_tokens = torch.zeros(E, device=device).index_add_(0, experts.flatten(), ones)[None]
            tokens = torch.full((1,), float(N), device=device)
            return Routing(expert_tokens, probabilities.sum(0, keepdim=True), tokens)
        sequence, S = self.sequences[0].to(torch.int64), self.sequences[1]
        # One more bin, S, for the padding, dropped after: its tokens count nowhere and its probabilities
        # get no gradient, as transformers' load_balancing_loss_func weighs them by the attention mask.
        slots = (sequence[:, None] * E + experts).flatten()  # (A,) sequence x expert of each assignment
        expert_tokens = torch.zeros((S + 1) * E, device=device).index_add_(0, slots, ones).view(S + 1, E)
        probability_sums = probabilities.new_zeros(S + 1, E).index_add(0, sequence, probabilities)
        tokens = torch.zeros(S + 1, device=device).index_add_(0, sequence, ones[:N])
        return Routing(expert_tokens[:S], probability_sums[:S], tokens[:S])
