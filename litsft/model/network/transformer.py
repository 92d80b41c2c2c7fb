"""The decoder-only transformer: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and 3, OLMo 2, Phi-3 and Phi-4, Granite in
one flat file, and the mixtures of experts (OLMoE, Qwen3-MoE, Qwen2-MoE, Mixtral), whose routed MLP is
litsft.model.network.moe's.

Shapes in comments: B batch, T query length, S key length, H query heads, K kv heads, D head dim,
C hidden size, V vocab size, N tokens of a packed row.

Packed batches: the data loader's rows (B, T) hold several documents each, padded at the end. For the
loss they are joined into one row (1, N) of their N real tokens (litsft.model.network.batch's `without_padding`: no layer
computes padding) with `Documents`, the cumulative lengths of the documents, built on the host; attention is then
causal *within* each document only. How attention does that (flash attention per document on a GPU,
one document at a time on the CPU, ...) is litsft.model.network.attention's business: the model calls `attend`.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from litsft.model.config import LONG_ROPE_TYPES, Config
from litsft.model.families import family_of
from litsft.model.network.attention import (
    Documents,
    Kernel,
    PreparedAttention,
    attend,
    choose_kernel,
    documents_of_ids,
    kernel_for_sinks,
    kernel_for_softcap,
    prepare,
    token_document_ids,
)
from litsft.model.network.batch import loss_positions_of, sequence_of_positions, without_padding
from litsft.model.network.context_parallel import ContextShard
from litsft.model.network.loss import chunked_cross_entropy, logits_dtype, loss_chunk_tokens, output_logits
from litsft.model.network.mlp import MLP
from litsft.model.network.moe import MoE, load_balancing_loss


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        """Gemma's form: scale by (1 + weight) in fp32, then cast; the weight starts at zero."""
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before scaling, as the HF implementations do: bit-for-bit
        # parity in bf16 depends on the order.
        # F.rms_norm is one fused kernel, and bit-identical to x * rsqrt(mean(x^2) + eps).
        x_normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.unit_offset:  # Gemma scales before the cast (transformers' Gemma2RMSNorm)
            return (x_normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x_normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)


def rms_norm(config: Config, size: int) -> RMSNorm:
    """The RMSNorm `config`'s family uses, over `size` values."""
    return RMSNorm(size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


def rope_inverse_frequencies(
    config: Config, device: torch.device | None = None, local: bool = False, long_context: bool = False
) -> torch.Tensor:
    """Per-pair rotation frequencies (R/2,) of the R = `config.rotary_dim` rotated dimensions, with Llama-3,
    linear or LongRoPE scaling applied when configured (LongRoPE: the long factors when `long_context`);
    `local`: those of the sliding layers with their own base (`Config.rope_local_base`), never scaled."""
    dim = config.rotary_dim
    base = config.rope_local_base if local else config.rope_theta
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    scaling = {} if local else config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in LONG_ROPE_TYPES:
        # LongRoPE: a factor per pair stretches its wavelength, in transformers' order of operations.
        factors = scaling["long_factor" if long_context else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * base**exponents)
    if rope_type == "yarn":
        return yarn_inverse_frequencies(base**exponents, scaling, dim, base, config.max_position_embeddings)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
        factor = scaling["factor"]
        low_freq_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
        high_freq_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def yarn_inverse_frequencies(
    wavelengths: torch.Tensor, scaling: dict, dim: int, base: float, max_position_embeddings: int
) -> torch.Tensor:
    """YaRN's frequencies from each pair's base ** (2i / R) (`wavelengths`, over 2 pi) (https://arxiv.org/abs/2309.00071): the pairs that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than `beta_fast` times kept,
    a linear ramp between, as transformers' _compute_yarn_parameters computes it (its `truncate`, true by
    default, rounds the ramp's ends outwards; gpt-oss sets it false)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        """The dimension whose pair turns `rotations` times over the original context."""
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp.to(wavelengths.device)  # (R/2,) the share of each pair's frequency kept
    # In transformers' order of operations, for the same bits.
    return 1.0 / (factor * wavelengths) * (1 - extrapolation) + 1.0 / wavelengths * extrapolation


def long_rope_length(config: Config) -> int | None:
    """LongRoPE's original_max_position_embeddings: a sequence longer than this is rotated with the long factors
    (all of it, as in transformers), so keys cached while it was shorter must be computed again. None: RoPE does
    not depend on the sequence's length."""
    if config.rope_type not in LONG_ROPE_TYPES:
        return None
    return int(config.rope_scaling["original_max_position_embeddings"])  # type: ignore[index]


def rope_attention_scaling(config: Config) -> float:
    """LongRoPE scales cos and sin, so the attention logits, by sqrt(1 + ln(s) / ln(n)) for a context stretched
    s times past its original n (or by its `attention_factor`), as transformers' _compute_longrope_parameters."""
    scaling = config.rope_scaling or {}
    if config.rope_type == "yarn":
        return yarn_attention_scaling(scaling, config.max_position_embeddings)
    if config.rope_type not in LONG_ROPE_TYPES:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_attention_scaling(scaling: dict, max_position_embeddings: int) -> float:
    """YaRN scales cos and sin by its `attention_factor`, else by 0.1 ln(factor) + 1 (DeepSeek's `mscale` and
    `mscale_all_dim` as a ratio of two such terms), as transformers' _compute_yarn_parameters."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]

    def mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def sequence_lengths(position_ids: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """The length of the sequence each token belongs to, (B, T): its document's (its last position + 1) in a
    joined row, else its row's. On the device, without a host sync."""
    if documents is None:
        return (position_ids.amax(dim=-1, keepdim=True) + 1).expand_as(position_ids)
    document_of_token = token_document_ids(documents.to(position_ids.device), position_ids.numel())
    last = torch.zeros(documents.cu_seqlens.numel() - 1, dtype=position_ids.dtype, device=position_ids.device)
    last = last.scatter_reduce(0, document_of_token, position_ids.flatten(), "amax", include_self=False)
    return (last[document_of_token] + 1).view_as(position_ids)


def routed_sequences(
    shape: tuple[int, int] | torch.Size,
    device: torch.device,
    documents: Documents | None,
    real_lengths: torch.Tensor | None,
    local: slice,
) -> tuple[torch.Tensor, int] | None:
    """The sequence of each token of whole rows `shape` (B, T) for a mixture of experts' per-sequence routing
    statistics (litsft.model.network.moe.MoE.sequences): each document of a joined row (`documents`, this
    rank's `local` slice of it under context parallelism), else each row. A token past the first
    `real_lengths[s]` tokens of its sequence s is padding and gets the id S, which the statistics leave out.
    None for one sequence without padding. On the device, without a host sync."""
    B, T = shape
    if documents is not None:
        documents = documents.to(device)
        sequence = token_document_ids(documents, B * T)
        cu_seqlens, S = documents.cu_seqlens, documents.cu_seqlens.numel() - 1
        offset = torch.arange(B * T, device=device) - cu_seqlens[sequence]  # each token's place in it
    else:
        sequence = torch.arange(B, device=device).repeat_interleave(T)
        S = B
        offset = torch.arange(T, device=device).repeat(B)
    if real_lengths is not None:
        sequence = torch.where(offset < real_lengths.to(device, non_blocking=True)[sequence], sequence, S)
    elif S == 1:
        return None
    return sequence[local], S


def rope_cos_sin(
    config: Config,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
    local: bool = False,
    documents: Documents | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position: (B, T) -> two (B, T, R) tensors, R = `config.rotary_dim`; `local`: the
    sliding layers' own base. With LongRoPE, each sequence (each document of a joined row) takes the short or
    the long factors by its own length: a document packed with others is rotated as it would be alone."""
    inv_freq = rope_inverse_frequencies(config, position_ids.device, local)  # (R/2,)
    threshold = None if local else long_rope_length(config)
    if threshold is not None:
        long = sequence_lengths(position_ids, documents) > threshold  # (B, T)
        long_inv_freq = rope_inverse_frequencies(config, position_ids.device, long_context=True)
        inv_freq = torch.where(long[..., None], long_inv_freq, inv_freq)  # (B, T, R/2)
    angles = position_ids.float()[..., None] * inv_freq  # (B, T, R/2), in fp32 for long contexts
    scale = 1.0 if local else rope_attention_scaling(config)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    # sin comes signed (-sin, sin) so that `apply_rope` rotates with a roll instead of a negated copy.
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by the angles in cos and the signed sin (B, T, R) of `rope_cos_sin`; pairs are
    (i, i + R/2) as in HF. With partial rotary (R < D) the last D - R dimensions pass through unrotated."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    # HF's x * cos + cat(-x2, x1) * sin, as one roll: 29% less CPU time forward and backward than the
    # negated copy (q of 1,966 tokens x 4 heads x 32, 1 thread).
    return x * cos[:, None] + x.roll(rotary // 2, dims=-1) * sin[:, None]


class KVCache:
    """Keys and values of earlier positions, for generation, in the compute dtype.

    The buffers are made at the first update, in the dtype of the values written: the dtype attention
    computes in (bf16 under bf16 autocast or FSDP2's bf16 parameters, whatever the weights are stored in).
    Keys are cast to it: under autocast RoPE's fp32 angles leave them in fp32, and attention would cast
    them down anyway."""

    def __init__(self, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int) -> None:
        self.shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def max_length(self) -> int:
        return self.shape[2]

    def update(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, K, T, D) at `positions` (T,) and return the whole cache (B, K, S, D)."""
        if self.k is None or self.v is None:
            self.k = torch.zeros(self.shape, device=v.device, dtype=v.dtype)
            self.v = torch.zeros(self.shape, device=v.device, dtype=v.dtype)
        self.k.index_copy_(2, positions, k.to(self.k.dtype))
        self.v.index_copy_(2, positions, v.to(self.v.dtype))
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        C, H, K, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(C, K * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(C, K * D, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=config.out_bias)
        # gpt-oss: each head's sink logit, which joins its softmax's denominator (litsft.model.network.attention).
        self.sinks = nn.Parameter(torch.zeros(H)) if config.attention_sinks else None
        if config.qk_norm:
            over_all_heads = config.qk_norm_over == "all_heads"
            self.q_norm = rms_norm(config, H * D if over_all_heads else D)
            self.k_norm = rms_norm(config, K * D if over_all_heads else D)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PreparedAttention,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, D = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        q, k = self.q_proj(x), self.k_proj(x)  # (B, T, H * D), (B, T, K * D)
        if self.config.qk_norm and self.config.qk_norm_over == "all_heads":  # OLMo 2
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, H, D), k.view(B, T, K, D)
        v = self.v_proj(x).view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        if self.config.qk_norm and self.config.qk_norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, K, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(attention.cache_positions, k, v)  # (B, K, S, D)
        dropout = self.config.attention_dropout if self.training else 0.0
        y = attend(
            q,
            k,
            v,
            attention,
            dropout,
            self.config.attention_scale(),
            self.config.softcap_attention,
            self.sinks,
        )  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, H * D))


class Block(nn.Module):
    def __init__(self, config: Config, layer: int = 0) -> None:
        """`layer`: the block's index, which says whether its MLP is routed (`Config.routes_experts`)."""
        super().__init__()
        C = config.hidden_size
        # Norms before (Llama), after (OLMo 2) or on both sides (Gemma's "sandwich") of attention and MLP.
        self.attn_norm = rms_norm(config, C) if config.pre_norms else nn.Identity()
        self.attn = Attention(config)
        self.attn_post_norm = rms_norm(config, C) if config.post_attention_norm else nn.Identity()
        self.mlp_norm = rms_norm(config, C) if config.pre_norms else nn.Identity()
        self.mlp = MoE(config) if config.routes_experts(layer) else MLP(config)
        self.mlp_post_norm = rms_norm(config, C) if config.post_mlp_norm else nn.Identity()
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: PreparedAttention,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + scaled(
            self.attn_post_norm(self.attn(self.attn_norm(x), cos, sin, attention, kv_cache)),
            self.residual_multiplier,
        )
        return x + scaled(self.mlp_post_norm(self.mlp(self.mlp_norm(x))), self.residual_multiplier)


def scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x times a config's multiplier (Granite's), as transformers multiplies: by the Python float; x itself at
    1.0, so the families without one run no extra kernel."""
    return x if multiplier == 1.0 else x * multiplier


BLOCK_VARIANTS: dict[str, type[nn.Module]] = {"pre_norm": Block}
"""The blocks a family can name (`Family.block`): "pre_norm", Llama's norm -> attention -> norm -> MLP, each
added to the residual stream; the config's `pre_norms`, `post_attention_norm` and `post_mlp_norm` move or add
norms (Gemma's sandwich, OLMo 2's post-norms) in the same block."""


class Transformer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        block = BLOCK_VARIANTS[family_of(config.hf_architecture).block]
        self.blocks = nn.ModuleList(block(config, i) for i in range(config.num_layers))
        self.norm = rms_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.kv_caches: list[KVCache] | None = None
        self.attention_kernel = None
        self.balancing_loss_sum: torch.Tensor | None = None
        """An MoE model's last training forward pass: its sequences' load-balancing losses, each weighted by
        its loss tokens (`router_loss_gradient`), detached."""
        self.loss_compiled = False
        """Whether the loss runs each chunk's cast and cross-entropy compiled: set with the blocks' compile
        (litsft.training.parallel.parallelize), the path `--train.compile` takes."""

    @property
    def routed_mlps(self) -> list[MoE]:
        """The mixtures of experts of the blocks that route their MLP (all of them but Qwen2-MoE's dense layers)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    @property
    def attention_kernel(self) -> Kernel | None:
        """litsft.model.network.attention's kernel for packed documents; None: chosen for the device at the first forward.
        A kernel that cannot soft-cap attention logits or take attention sinks is replaced, when set, by one that
        can (litsft.model.network.attention.kernel_for_softcap, kernel_for_sinks), so the kernel the engine logs is the one that runs."""
        return self._attention_kernel

    @attention_kernel.setter
    def attention_kernel(self, kernel: Kernel | None) -> None:
        if kernel is not None and self.config.softcap_attention is not None:
            kernel = kernel_for_softcap(kernel)
        if kernel is not None and self.config.attention_sinks:
            kernel = kernel_for_sinks(kernel)
        self._attention_kernel = kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_positions: torch.Tensor | None = None,
        documents: Documents | None = None,
        context: ContextShard | None = None,
        real_lengths: torch.Tensor | None = None,
        per_sequence: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, V) for tokens (B, T); with `labels` (B, T) instead the summed fp32 cross-entropy over
        the positions whose label is not -100; with `per_sequence` too, one such sum per sequence (S,) (each
        document of `documents`, else each row): minus the log-probability of its targets, what preference
        objectives compare (a mixture of experts' balancing term is then left to the caller).
        `loss_positions`, the flat indices of those labels
        (`loss_positions_of(labels)`), are best computed where the labels are made, on the host: finding them
        on a GPU makes the host wait.

        Packed rows: either `documents` with the row (1, N) of real tokens they describe (what the engine
        passes, built on the host by litsft.model.network.batch.model_inputs), or `document_ids` (B, T), -1 on padding, from which
        the same are found here (reading the ids: a host sync on a GPU).

        `context`: this rank's place in a context group of size > 1 (context parallelism): `input_ids`,
        `labels` and `loss_positions` are this rank's tokens, `position_ids` and `documents` the whole row's,
        as litsft.model.network.context_parallel.split_for_context gives them; the loss is this rank's tokens'.

        `real_lengths` (S,): how many tokens at the start of each sequence (each row, or each document of
        `documents`) are real, the rest being padding, which a mixture of experts leaves out of its routing
        statistics (the load-balancing loss and the expert load); None: no padding. Made on the host with
        the batch (litsft.model.network.batch.model_inputs), so the device never reports it back."""
        if context is not None and context.size == 1:
            context = None
        if documents is None and document_ids is not None:
            if labels is not None:
                input_ids, position_ids, document_ids, labels = without_padding(
                    input_ids, position_ids, document_ids, labels
                )
                loss_positions = None  # found again in the new layout
            documents = documents_of_ids(document_ids)
        hidden = self.hidden_states(input_ids, position_ids, documents, context, real_lengths)
        if labels is None:
            return self.logits(hidden)
        hidden_rows = hidden.shape[0]
        hidden, labels = hidden.flatten(0, 1), labels.flatten()
        if loss_positions is None:
            loss_positions = loss_positions_of(labels)  # waits for a GPU: callers pass them
        token_index, segments, num_segments = None, None, 0
        if per_sequence:
            if context is not None:
                raise NotImplementedError("per-sequence losses are not split over a context group")
            width = labels.numel() // hidden_rows
            segments, num_segments = sequence_of_positions(loss_positions, documents, hidden_rows, width)
        if loss_positions.numel() < labels.numel():
            # The output head runs on the tokens that carry a loss only: with the prompt masked, that skips
            # most of its work (and a 128k-vocabulary head is a fifth of a 1B model's).
            hidden, labels, token_index = hidden[loss_positions], labels[loss_positions], loss_positions
        loss = chunked_cross_entropy(
            hidden,
            self.lm_head,
            labels,
            chunk_size=loss_chunk_tokens(self.config.vocab_size, logits_dtype(hidden)),
            softcap=self.config.softcap_final,
            compiled=self.loss_compiled,
            scaling=self.config.logits_scaling,
            token_index=token_index,
            segments=segments,
            num_segments=num_segments,
        )
        if self.training and self.routed_mlps and not per_sequence:
            loss = loss + self.router_loss_gradient(loss_positions, context)
        return loss

    def router_loss_gradient(
        self, loss_positions: torch.Tensor, context: ContextShard | None = None
    ) -> torch.Tensor:
        """A zero whose gradient is that of coef x the sum over this micro-batch's sequences of each one's
        load-balancing loss (litsft.model.network.moe.load_balancing_loss) weighted by its loss tokens. The value of
        the loss `forward` returns stays the summed cross-entropy, what is logged; the training step divides it
        by the global loss-token count, so the objective gains coef x the loss-token-weighted mean of every
        sequence's balancing loss, the same however the sequences are split into micro-batches and ranks.
        That weighted sum, detached, is kept in `balancing_loss_sum` for the logs.

        The term is built in the forward pass from the probabilities the routers' softmax made: autograd runs
        the routers' backward only once the gradient through the rest of their block has arrived too, after
        FSDP2 has gathered the block's parameters again.

        Under context parallelism `loss_positions` are this rank's, and each sequence's routing statistics are
        summed over the context group first (moe.load_balancing_loss), so each sequence's loss is the whole
        sequence's; weighted by this rank's loss tokens, the terms of the group's ranks add up to one
        process's, and so do their gradients (the all-reduce's backward sums the ranks' gradients)."""
        routed = self.routed_mlps
        routings = [mlp.routing for mlp in routed]
        sequences = routings[0].tokens.shape[0]
        sequence_of = routed[0].sequences
        of_loss_token = sequence_of[0][loss_positions] if sequence_of is not None else loss_positions * 0
        loss_tokens = torch.zeros(sequences, device=loss_positions.device).index_add_(
            0, of_loss_token.long(), torch.ones(loss_positions.numel(), device=loss_positions.device)
        )
        balancing = load_balancing_loss(routings, self.config.num_experts, context.group if context else None)
        weighted = (balancing * loss_tokens).sum()
        self.balancing_loss_sum = weighted.detach()
        term = self.config.router_aux_loss_coef * weighted
        return term - term.detach()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden states (..., C) -> (..., V), scaled and soft-capped as the config says
        (litsft.model.network.loss.output_logits, which the loss applies too)."""
        return output_logits(self.lm_head(hidden), self.config.logits_scaling, self.config.softcap_final)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the config ties them. Called again after
        `to_empty`, which gives shared parameters separate storage."""
        if self.config.tie_word_embeddings:
            head = getattr(
                self.lm_head, "base", self.lm_head
            )  # a LoRA-wrapped head keeps the frozen weight in .base
            head.weight = self.embed.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        documents: Documents | None = None,
        context: ContextShard | None = None,
        real_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalized hidden states (B, T, C), before the output projection. The training loss uses
        this to compute cross-entropy in chunks without materializing all (B, T, V) logits at once.
        With `documents`, the rows are one sequence of documents joined in order. With a `context` of size
        N > 1, `input_ids` (B, T/N) are this rank's slice of rows whose `position_ids` and `documents` are
        whole (B, T): attention and RoPE are prepared for the whole rows, and (B, T/N, C) come back.
        `real_lengths`: as in `forward`."""
        if context is not None and context.size == 1:
            context = None
        B, T = input_ids.shape
        if context is not None:
            if self.kv_caches is not None or (documents is not None and B > 1):
                raise ValueError(
                    "context parallelism takes one joined row (split_for_context), never a KV cache"
                )
            T = T * context.size
        if position_ids is None:
            if self.kv_caches is not None:
                raise ValueError("decoding with a KV cache needs position_ids")
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        local = context.local(T) if context is not None else slice(None)  # this rank's tokens of each row
        joined = documents is not None and B > 1
        if joined:
            input_ids, position_ids = input_ids.reshape(1, B * T), position_ids.reshape(1, B * T)
        x = self.embed(input_ids)  # (B, T, C), or (1, B * T, C) joined
        if self.config.scale_embeddings:
            # Gemma: sqrt(C) rounded to the embedding dtype first, as transformers does.
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        x = scaled(x, self.config.embedding_multiplier)  # Granite
        if torch.is_autocast_enabled(x.device.type):
            # The residual stream stays fp32 under autocast, also when a frozen embedding is stored in the
            # compute dtype (LoRA under bf16-mixed): only the matmuls run in 16 bits.
            x = x.float()
        prepared = self.prepare_attention(
            tuple(position_ids.shape), x.device, documents, position_ids, context
        )
        layers = range(self.config.num_layers)
        ropes = {
            sliding: tuple(
                part[:, local]  # computed whole: LongRoPE picks its factors by the whole document's length
                for part in rope_cos_sin(self.config, position_ids, x.dtype, sliding, documents)
            )
            for sliding in {self.config.uses_local_rope(i) for i in layers}
        }  # one (cos, sin) per RoPE base the layers use
        if self.config.num_experts:  # each token's sequence, for the routers' per-sequence statistics
            sequences = routed_sequences(position_ids.shape, x.device, documents, real_lengths, local)
            for mlp in self.routed_mlps:
                mlp.sequences = sequences
        for i, block in enumerate(self.blocks):
            kv_cache = self.kv_caches[i] if self.kv_caches is not None else None
            cos, sin = ropes[self.config.uses_local_rope(i)]
            x = block(x, cos, sin, prepared[self.config.attention_window(i)], kv_cache)
        x = self.norm(x)
        return x.view(B, T, -1) if joined else x

    def prepare_attention(
        self,
        shape: tuple[int, int],
        device: torch.device,
        documents: Documents | None,
        position_ids: torch.Tensor,
        context: ContextShard | None = None,
    ) -> dict[int | None, PreparedAttention]:
        """What the layers' attention shares in this forward pass, for each window a layer uses; under
        context parallelism, for the whole rows of `shape`, with `context` for `attend`'s all-to-alls."""
        if self.attention_kernel is None:
            self.attention_kernel = self.default_attention_kernel(device)
        decoding = self.kv_caches is not None
        documents = documents.to(device) if documents is not None else None
        windows = {self.config.attention_window(i) for i in range(self.config.num_layers)}
        prepared = {
            window: prepare(
                self.attention_kernel,
                shape,
                device,
                documents=documents,
                window=window,
                cache_positions=position_ids[0] if decoding else None,
                cache_length=self.kv_caches[0].max_length if decoding else 0,
            )
            for window in windows
        }
        for attention in prepared.values():
            attention.context = context
        return prepared

    def default_attention_kernel(self, device: torch.device) -> Kernel:
        """The kernel for this device when no one chose one (the engine chooses at setup and logs it)."""
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        return choose_kernel(
            device.type,
            dtype or self.embed.weight.dtype,
            windowed=self.config.sliding_window is not None,
            dropout=self.config.attention_dropout,
        )

    def setup_kv_caches(self, batch_size: int, max_length: int) -> None:
        C = self.config
        self.kv_caches = [KVCache(batch_size, max_length, C.num_kv_heads, C.head_dim) for _ in self.blocks]

    def clear_kv_caches(self) -> None:
        self.kv_caches = None

    def initial_value(
        self, name: str, shape: torch.Size, generator: torch.Generator, std: float = 0.02
    ) -> torch.Tensor:
        """Fresh value of parameter `name` for pretraining: normal(0, std), norms at a unit scale, biases at
        zero, and the projections that write into the residual stream scaled by 1/sqrt(2 * num_layers) so its
        variance does not grow with depth. Drawn from `generator` alone, so the result does not depend on how
        it is sharded."""
        if name.endswith("norm.weight"):  # a unit scale: Gemma's norms scale by (1 + weight)
            return torch.zeros(shape) if self.config.norm_unit_offset else torch.ones(shape)
        if name.endswith((".bias", "_bias")):  # experts' biases too (gate_up_proj_bias)
            return torch.zeros(shape)
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            std = std / math.sqrt(2 * self.config.num_layers)
        return torch.randn(shape, generator=generator) * std

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter of an unsharded model with `initial_value`."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name, param.shape, parameter_generator(seed, name)))


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded by the run seed and the parameter's name: the same draw on any number of ranks."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
