"""The decoder-only transformer: Llama, Mistral, Qwen2/2.5 and Qwen3 in one flat file.

Shapes in comments: B batch, T query length, S key length, H query heads, K kv heads, D head dim,
C hidden size, V vocab size.

Packed batches: pass `position_ids` (restarting at 0 for each document) and `document_ids` (the index
of the document each token belongs to); attention is then causal *within* each document only. On the CPU
the documents are cut out of their rows and attended to one length bucket at a time (`DocumentSegments`),
so attention costs the sum of squared document lengths instead of rows x T^2, and the loss path drops the
padding at the ends of rows before the first layer (`without_padding`); on a GPU a boolean mask keeps the
forward free of host syncs.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from litsft.config import Config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before scaling, as the HF implementations do: bit-for-bit
        # parity in bf16 depends on the order.
        # F.rms_norm is one fused kernel, and bit-identical to x * rsqrt(mean(x^2) + eps).
        x_normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x_normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inverse_frequencies(config: Config, device: torch.device | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies (D/2,), with Llama-3 or linear scaling applied when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
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


def rope_cos_sin(
    config: Config, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position: (B, T) -> two (B, T, D) tensors."""
    inv_freq = rope_inverse_frequencies(config, position_ids.device)
    angles = position_ids.float()[..., None] * inv_freq  # (B, T, D/2), in fp32 for long contexts
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) by the angles in cos/sin (B, T, D); pairs are (i, i + D/2) as in HF."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class KVCache(nn.Module):
    """Keys and values of earlier positions, for generation."""

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(
        self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, K, T, D) at `positions` (T,) and return the whole cache (B, K, S, D)."""
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
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
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | DocumentSegments | None,
        kv_cache: KVCache | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, D = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, K, D)
        v = self.v_proj(x).view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, K, T, D)
        if kv_cache is not None:
            k, v = kv_cache.update(cache_positions, k, v)  # (B, K, S, D)
        dropout = self.config.attention_dropout if self.training else 0.0
        if isinstance(mask, DocumentSegments):
            y = segmented_attention(q, k, v, mask, dropout)  # (B, T, H, D)
            return self.o_proj(y.reshape(B, T, H * D))
        if mask is None and q.device.type == "cpu":
            y = chunked_causal_attention(q, k, v, dropout)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
        # Grouped-query attention: each kv head serves H // K query heads. The kernels that take an explicit
        # mask on a GPU (memory-efficient attention) do not do the grouping themselves.
        grouped = K != H and mask is None
        if K != H and not grouped:
            k = k.repeat_interleave(H // K, dim=1)
            v = v.repeat_interleave(H // K, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, enable_gqa=grouped
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | DocumentSegments | None,
        kv_cache: KVCache | None = None,
        cache_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv_cache, cache_positions)
        return x + self.mlp(self.mlp_norm(x))


def attention_mask(
    document_ids: torch.Tensor | None,
    query_positions: torch.Tensor | None = None,
    key_length: int | None = None,
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, T, S) where True means "may attend", or None for plain causal attention.

    document_ids (B, T): a packed batch; a token attends to earlier tokens of its own document only.
    query_positions (T,) with key_length S: decoding against a KV cache of S slots.
    """
    if document_ids is not None:
        T = document_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
        same_document = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
        return (same_document & causal)[:, None]
    if query_positions is not None:
        key_positions = torch.arange(key_length, device=query_positions.device)
        return (key_positions[None, :] <= query_positions[:, None])[None, None]  # (1, 1, T, S)
    return None


@dataclass
class DocumentSegments:
    """The documents of a packed batch, regrouped for causal attention one length bucket at a time.

    Bucket i holds n_i documents padded at the end to length L_i: `gather[i]` (n_i, L_i) are the flat
    (B*T) positions of their tokens (a padding slot repeats the document's first token: causal attention
    never lets a real token see a later slot, so padding changes nothing), `keep[i]` (m_i,) the flat
    indices into (n_i * L_i) of the real slots. `order` (B*T,) puts the concatenated real slots back into
    row order. The padding at the end of a row (document id -1) is one more document, as in the mask.
    """

    gather: list[torch.Tensor]
    keep: list[torch.Tensor]
    order: torch.Tensor


SEGMENT_BUCKET_RATIO = 0.75
"""A bucket takes documents down to this share of its longest one: at most 1/0.75^2 = 1.8x the attention
work of exact per-document attention, in a handful of kernel calls."""
SEGMENT_MIN_LENGTH = 64
"""Documents up to this long share one bucket: below it, a kernel call costs more than the padding."""


def document_segments(document_ids: torch.Tensor) -> DocumentSegments:
    """Plan `segmented_attention` for document_ids (B, T) on the CPU (it reads them: a host sync elsewhere)."""
    B, T = document_ids.shape
    flat = document_ids.flatten()
    starts_mask = torch.ones(B * T, dtype=torch.bool)
    starts_mask[1:] = flat[1:] != flat[:-1]
    starts_mask[::T] = True  # every row starts a document
    starts = starts_mask.nonzero().flatten()
    lengths = torch.diff(starts, append=torch.tensor([B * T]))
    by_length = torch.argsort(lengths, descending=True, stable=True).tolist()
    length_list = lengths.tolist()
    buckets: list[list[int]] = []
    for doc in by_length:
        longest = length_list[buckets[-1][0]] if buckets else 0
        if buckets and (length_list[doc] >= SEGMENT_BUCKET_RATIO * longest or longest <= SEGMENT_MIN_LENGTH):
            buckets[-1].append(doc)
        else:
            buckets.append([doc])
    gather, keep, placed = [], [], []
    for bucket in buckets:
        docs = torch.tensor(bucket)
        L = length_list[bucket[0]]
        offsets = torch.arange(L)
        slots = offsets[None, :] < lengths[docs][:, None]  # (n, L)
        gather.append(starts[docs][:, None] + torch.where(slots, offsets, 0))
        keep.append(slots.flatten().nonzero().flatten())
        placed.append(gather[-1].flatten()[keep[-1]])
    order = torch.empty(B * T, dtype=torch.long)
    order[torch.cat(placed)] = torch.arange(B * T)
    return DocumentSegments(gather, keep, order)


def segmented_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: DocumentSegments, dropout: float
) -> torch.Tensor:
    """Causal attention within each document: q (B, H, T, D), k and v (B, K, T, D) -> (B, T, H, D)."""
    B, H, T, D = q.shape
    K = k.shape[1]
    q = q.transpose(1, 2).reshape(B * T, H, D)
    k, v = (x.transpose(1, 2).reshape(B * T, K, D) for x in (k, v))
    outputs = []
    for gather, keep in zip(segments.gather, segments.keep):
        n, L = gather.shape
        qb, kb, vb = (x[gather].transpose(1, 2) for x in (q, k, v))  # (n, H or K, L, D)
        y = chunked_causal_attention(qb, kb, vb, dropout)
        outputs.append(y.transpose(1, 2).reshape(n * L, H, D)[keep])
    return torch.cat(outputs)[segments.order].view(B, T, H, D)


QUERY_CHUNK = 96
"""Queries per SDPA call in `chunked_causal_attention` (measured best on the CPU for head_dim 32, 1 thread)."""


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float
) -> torch.Tensor:
    """Causal SDPA of q (n, H, L, D) over k, v (n, K, L, D), a chunk of queries at a time.

    The CPU flash kernel computes every score of an L x L block, masked or not (causal is no faster than
    full attention there). Queries [a, b) only need keys [0, b): in c chunks that is (c + 1) / 2c of the
    work, 20-30% less time for L = 256-512 (tests/test_model.py checks the result against one call).
    """
    L = q.shape[2]
    chunks = -(-L // QUERY_CHUNK)
    grouped = k.shape[1] != q.shape[1]
    if chunks == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)
    bounds = [L * j // chunks for j in range(chunks + 1)]
    outputs = []
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    for start, end, q_chunk in zip(bounds, bounds[1:], q.split(sizes, dim=2)):
        # The lower-right causal mask: query start + i sees keys up to start + i.
        mask = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        outputs.append(
            F.scaled_dot_product_attention(
                q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask, dropout_p=dropout, enable_gqa=grouped
            )
        )
    return torch.cat(outputs, dim=2)


def _chunk_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # (N, V)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def without_padding(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed batch (B, T) as one row (1, N) of its N real tokens, dropping the padding (document id -1)
    that fills the ends of rows, so that no layer computes it. For the CPU, where attention cuts documents
    out of rows anyway (`DocumentSegments`). Document ids are made unique across rows, so that the last
    document of one row and the first of the next stay apart."""
    B, T = document_ids.shape
    real = (document_ids >= 0).flatten()
    if bool(real.all()) or not bool(real.any()):  # nothing to drop, or an all-padding filler batch
        return input_ids, position_ids, document_ids, labels
    if position_ids is None:
        position_ids = torch.arange(T).expand(B, T)
    document_ids = document_ids + T * torch.arange(B)[:, None]
    return tuple(x.flatten()[real][None] for x in (input_ids, position_ids, document_ids, labels))


def loss_positions_of(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the labels (B, T) that carry a loss (are not -100)."""
    return (labels.flatten() != -100).nonzero().flatten()


def chunked_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_size: int = 2048
) -> torch.Tensor:
    """Summed cross-entropy of head(hidden (N, C)) against labels (N,), `chunk_size` tokens at a time.

    Each chunk's logits are recomputed in the backward pass instead of kept, so the full (N, V) fp32
    logits (2 GiB for one 4k sequence with a 128k vocabulary) never exist.
    """
    if hidden.shape[0] <= chunk_size:
        return _chunk_cross_entropy(hidden, head, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(
            _chunk_cross_entropy, hidden[start:end], head, labels[start:end], use_reentrant=False
        )
    return total


class Transformer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.kv_caches: list[KVCache] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for tokens (B, T); with `labels` (B, T) instead the summed fp32 cross-entropy over
        the positions whose label is not -100. `loss_positions`, the flat indices of those labels
        (`loss_positions_of(labels)`), are best computed where the labels are made, on the CPU: finding them
        on a GPU makes the host wait. See the module docstring for packed batches."""
        if labels is not None and document_ids is not None and document_ids.device.type == "cpu":
            input_ids, position_ids, document_ids, labels = without_padding(
                input_ids, position_ids, document_ids, labels
            )
            loss_positions = None  # the CPU finds them again in the new layout, for free
        hidden = self.hidden_states(input_ids, position_ids, document_ids)
        if labels is None:
            return self.lm_head(hidden)
        hidden, labels = hidden.flatten(0, 1), labels.flatten()
        if loss_positions is None:
            loss_positions = loss_positions_of(labels)  # waits for a GPU: callers pass them
        if loss_positions.numel() < labels.numel():
            # The output head runs on the tokens that carry a loss only: with the prompt masked, that skips
            # most of its work (and a 128k-vocabulary head is a fifth of a 1B model's).
            hidden, labels = hidden[loss_positions], labels[loss_positions]
        return chunked_cross_entropy(hidden, self.lm_head, labels)

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
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalized hidden states (B, T, C), before the output projection. The training loss uses
        this to compute cross-entropy in chunks without materializing all (B, T, V) logits at once."""
        B, T = input_ids.shape
        cache_positions = None
        if self.kv_caches is not None:
            if position_ids is None:
                raise ValueError("decoding with a KV cache needs position_ids")
            cache_positions = position_ids[0]
            mask = attention_mask(None, cache_positions, self.kv_caches[0].k.shape[2])
        else:
            if position_ids is None:
                position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
            if document_ids is not None and document_ids.device.type == "cpu":
                mask = document_segments(document_ids)
            else:
                mask = attention_mask(document_ids)
        x = self.embed(input_ids)  # (B, T, C)
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)
        for i, block in enumerate(self.blocks):
            kv_cache = self.kv_caches[i] if self.kv_caches is not None else None
            x = block(x, cos, sin, mask, kv_cache, cache_positions)
        return self.norm(x)

    def setup_kv_caches(self, batch_size: int, max_length: int) -> None:
        param = self.embed.weight
        self.kv_caches = [
            KVCache(
                batch_size,
                max_length,
                self.config.num_kv_heads,
                self.config.head_dim,
                param.device,
                param.dtype,
            )
            for _ in self.blocks
        ]

    def clear_kv_caches(self) -> None:
        self.kv_caches = None

    def initial_value(
        self, name: str, shape: torch.Size, generator: torch.Generator, std: float = 0.02
    ) -> torch.Tensor:
        """Fresh value of parameter `name` for pretraining: normal(0, std), norms at one, biases at zero, and the
        projections that write into the residual stream scaled by 1/sqrt(2 * num_layers) so its variance does
        not grow with depth. Drawn from `generator` alone, so the result does not depend on how it is sharded."""
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
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
