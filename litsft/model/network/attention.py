"""Causal self-attention for litsft's model: every kernel behind one function, `attend`.

The model hands each layer's queries, keys and values to `attend` with a `PreparedAttention`: what one
forward pass needs for one attention pattern, built once per forward by `prepare` and shared by the
layers. Three patterns:

- plain causal rows (B, T) (each row one sequence; padding only at row ends, never attended to);
- documents: packed rows joined into one row (1, N) and cut into documents by `Documents` (cumulative
  lengths, built on the host where the batch is built); a token attends to its own document only;
- decoding: T new queries against a KV cache of S slots, at known positions.

Each may have a sliding window (Mistral, Qwen2): a query then sees only the `window` latest keys of its
document, itself included, as transformers' `sliding_window_overlay` (key > query - window).

The kernel is chosen once per run (`choose_kernel`) and named in the log:

| kernel    | device | documents                                                   | windows |
|-----------|--------|-------------------------------------------------------------|---------|
| varlen    | CUDA sm80+ | torch.nn.attention.varlen flash attention per document  | where varlen_attn takes window_size |
| flex      | CUDA sm70+ | flex_attention with a document block mask               | yes |
| mask      | any    | SDPA a chunk of queries at a time, mask rows built per chunk: last resort | yes |
| segmented | CPU    | each document a view of the row, attended on its own        | yes |

Plain causal rows without a window go to SDPA's causal flash kernel on a GPU and to query chunks on the
CPU; decoding uses SDPA with a boolean mask everywhere (a few queries: the kernel hardly matters). No path
that trains builds an N x N mask or N x N scores: the mask kernel and soft-capped attention run a chunk of
queries at a time (`chunked_attention`), so that rows of 32k-128k tokens cost memory linear in N.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from litsft.model.network.context_parallel import (
    ContextShard,
    heads_from_tokens,
    kv_heads_for_context,
    tokens_from_heads,
)

Kernel = Literal["varlen", "flex", "mask", "segmented"]
KERNEL_DESCRIPTIONS: dict[str, str] = {
    "varlen": "flash attention per document (torch.nn.attention.varlen)",
    "flex": "flex_attention with a document block mask",
    "mask": "scaled_dot_product_attention with a boolean document mask, a chunk of queries at a time",
    "segmented": "per-document SDPA, one document at a time (CPU)",
}
SOFTCAPPED_KERNEL_DESCRIPTIONS: dict[str, str] = {
    "flex": "flex_attention with a document block mask, the soft-cap in its score_mod",
    "mask": "soft-capped attention written out, a chunk of queries at a time (scores, cap, mask, softmax)",
}
"""What runs for a model whose attention logits are soft-capped (Gemma 2): SDPA cannot cap them, so the mask
kernel writes the scores out, a chunk of queries at a time (`chunked_attention`); `kernel_for_softcap` never
leaves another kernel set."""
SINK_KERNEL_DESCRIPTION = "attention with sinks written out, a chunk of queries at a time (scores, mask, softmax with each head's sink)"
"""What runs for a model with attention sinks (gpt-oss) on every device: `kernel_for_sinks`."""


def describe_kernel(kernel: Kernel, softcapped: bool = False, sinks: bool = False) -> str:
    """The attention that runs for `kernel`, in words, for the start-up line: for a soft-capped model (Gemma 2)
    the capped path it takes, for a model with attention sinks (gpt-oss) the written-out one, not the SDPA call
    they replace."""
    if sinks:
        return SINK_KERNEL_DESCRIPTION
    return SOFTCAPPED_KERNEL_DESCRIPTIONS[kernel] if softcapped else KERNEL_DESCRIPTIONS[kernel]


# ---- document boundaries ------------------------------------------------------------------------------
@dataclass
class Documents:
    """The documents of one row of N tokens: document i is tokens [cu_seqlens[i], cu_seqlens[i + 1]).

    Built on the host (the data loader's collate writes `cu_seqlens` and `max_seqlen`; `documents_of_ids`
    finds them from document ids), so that no kernel has to read the boundaries back from the device: varlen takes them as they are, the
    mask and flex kernels turn them into per-token document ids on the device, the CPU cuts documents out
    with them.
    """

    cu_seqlens: torch.Tensor
    """(D + 1,) int32: 0, then the running total of the document lengths."""
    max_seqlen: int
    """The longest document (varlen sizes its grid with it)."""

    def to(self, device: torch.device) -> Documents:
        return Documents(self.cu_seqlens.to(device, non_blocking=True), self.max_seqlen)


def cumulative_lengths(lengths: list[int]) -> torch.Tensor:
    """(D + 1,) int32 cumulative sequence lengths of documents of these lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def documents_of_ids(document_ids: torch.Tensor) -> Documents:
    """The documents of document_ids (B, T), rows joined in order: every run of equal ids is one document
    (a row's end padding, id -1, too). Reads the ids on the host: a sync on a GPU. The data loader builds
    `cu_seqlens` itself; this is for callers that pass document ids alone."""
    B, T = document_ids.shape
    flat = document_ids.detach().flatten().cpu()
    starts = torch.ones(B * T, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True  # every row starts a document
    start_positions = starts.nonzero().flatten()
    lengths = torch.diff(start_positions, append=torch.tensor([B * T]))
    return Documents(cumulative_lengths(lengths.tolist()).to(document_ids.device), int(lengths.max()))


def token_document_ids(documents: Documents, num_tokens: int) -> torch.Tensor:
    """(N,) the document index of every token, on the boundaries' device without a host sync."""
    positions = torch.arange(num_tokens, device=documents.cu_seqlens.device, dtype=torch.int32)
    return document_of_positions(documents, positions)


def document_of_positions(documents: Documents, positions: torch.Tensor) -> torch.Tensor:
    """The document index of each of `positions` (flat indices into the row the documents describe), found on
    the device without a host sync."""
    return torch.searchsorted(documents.cu_seqlens[1:].to(positions.dtype), positions, right=True)


# ---- choosing the kernel --------------------------------------------------------------------------------
def _varlen_attn() -> Any | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_features(function: Any) -> set[str]:
    """Which optional arguments this torch's varlen_attn takes ("enable_gqa", "window_size", "is_causal",
    "scale"), read from the signature, not the version: torch 2.10's takes is_causal only; 2.11's takes
    window_size (causal when it is (-1, 0)) and scale, but no enable_gqa; 2.12's adds enable_gqa
    (torch/nn/attention/varlen.py of each release's wheel)."""
    parameters = inspect.signature(function).parameters
    return {name for name in ("enable_gqa", "window_size", "is_causal", "scale") if name in parameters}


FLASH_CAPABILITIES = ((8, 0), (12, 1))
"""The GPU generations torch's flash attention (and so varlen_attn) runs on: sm80 to sm121, Ampere and
newer, not V100 (sm70) or T4 (sm75); `check_flash_attention_hardware_support` in
https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"""
TRITON_CAPABILITY = (7, 0)
"""flex_attention is generated by Triton, which needs sm70 or newer (`GPUTooOldForTriton` in
https://github.com/pytorch/pytorch/blob/main/torch/_inductor/exc.py)."""


@dataclass(frozen=True)
class KernelSupport:
    """What this torch and this GPU offer: varlen_attn's optional keyword arguments (None: no varlen_attn),
    flex_attention, and the GPU's compute capability (major, minor)."""

    varlen: frozenset[str] | None
    flex: bool
    capability: tuple[int, int]

    @classmethod
    def installed(cls) -> KernelSupport:
        """The installed torch's, on the current CUDA device."""
        function = _varlen_attn()
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

            flex = True
        except ImportError:
            flex = False
        varlen = frozenset(varlen_features(function)) if function is not None else None
        return cls(varlen, flex, torch.cuda.get_device_capability())


def choose_kernel(
    device_type: str,
    compute_dtype: torch.dtype,
    windowed: bool,
    dropout: float,
    support: KernelSupport | None = None,
) -> Kernel:
    """The attention kernel for packed documents on this device, chosen once per run: flash attention per
    document where the GPU and torch have it, else flex_attention where Triton runs, else the mask.

    Args:
        device_type: "cuda", "cpu", ...
        compute_dtype: The dtype attention runs in (bfloat16 under bf16-mixed); flash kernels need 16 bits.
        windowed: Whether some layer has a sliding window.
        dropout: Attention dropout while training; only SDPA (mask, segmented) applies it.
        support: What torch and the GPU offer; default: the installed torch's, on the current GPU.
    """
    if device_type != "cuda":
        return "segmented" if device_type == "cpu" else "mask"
    if dropout > 0:
        return "mask"
    support = support or KernelSupport.installed()
    sixteen_bits = compute_dtype in (torch.bfloat16, torch.float16)
    flash = FLASH_CAPABILITIES[0] <= support.capability <= FLASH_CAPABILITIES[1]
    if (
        flash
        and support.varlen is not None
        and sixteen_bits
        and (not windowed or "window_size" in support.varlen)
    ):
        return "varlen"
    if support.flex and support.capability >= TRITON_CAPABILITY:
        return "flex"
    return "mask"


def kernel_for_softcap(kernel: Kernel, support: KernelSupport | None = None) -> Kernel:
    """The kernel that runs in place of `kernel` when attention logits are soft-capped (Gemma 2): flex applies
    the cap in its score_mod, the mask kernel writes the scores out (`written_out_attention`); varlen's flash
    kernel and the CPU's per-document SDPA cannot apply it, so they give way to flex where torch has it, else to
    the mask kernel."""
    if kernel in ("flex", "mask"):
        return kernel
    if kernel == "varlen":  # a GPU that runs flash attention runs Triton too
        support = support or KernelSupport.installed()
        if support.flex and support.capability >= TRITON_CAPABILITY:
            return "flex"
    return "mask"


def kernel_for_sinks(kernel: Kernel) -> Kernel:
    """The kernel that runs when each head has an attention sink (gpt-oss: a learned logit that joins the
    softmax's denominator and adds no value): the mask kernel, on every device, whose written-out scores take
    the sink as one more column (`written_out_attention`), exactly and with memory linear in the row. The fused
    kernels cannot take it: SDPA has no such argument, flex's score_mod rewrites scores but adds no term to
    the denominator, and the sink's exact form from a kernel's log-sum-exp (out * sigmoid(lse - sink)) needs
    a log-sum-exp that carries a gradient, which SDPA's and varlen's do not."""
    return "mask"


# ---- per forward: what the layers share -----------------------------------------------------------------
@dataclass
class PreparedAttention:
    """What `attend` needs for one forward pass and one window, shared by the layers that use it."""

    kernel: Kernel
    pattern: Literal["causal", "documents", "decode"]
    window: int | None = None
    documents: Documents | None = None
    rows_as_documents: bool = False
    """Plain causal rows (B, T) with a window, handed to a document kernel as one row of B documents."""
    mask: torch.Tensor | None = None
    """Decoding: boolean (1, 1, T, S), True where a query may attend."""
    segments: list[int] | None = None
    """The segmented kernel (the CPU's): the lengths of the row's documents, on the host."""
    block_mask: Any = None
    cache_positions: torch.Tensor | None = None
    """Decoding: the cache slots (T,) the new keys and values go to."""
    varlen_attn: Any = None
    """torch's varlen_attn and the optional arguments it takes, looked up here, outside compiled code."""
    varlen_features: frozenset[str] = frozenset()
    context: ContextShard | None = None
    """Context parallelism: q, k, v hold this rank's tokens, the rest of this object describes the whole row
    (`attend` trades tokens for heads around the kernel, litsft.model.network.context_parallel)."""


def prepare(
    kernel: Kernel,
    shape: tuple[int, int],
    device: torch.device,
    documents: Documents | None = None,
    window: int | None = None,
    cache_positions: torch.Tensor | None = None,
    cache_length: int = 0,
) -> PreparedAttention:
    """Build what the layers share for one forward pass over tokens of `shape` (B, T): `documents` for a
    packed row (B = 1), `cache_positions` (T,) and `cache_length` S for decoding, neither for plain rows."""
    if cache_positions is not None:
        keys = torch.arange(cache_length, device=device)
        visible = keys[None, :] <= cache_positions[:, None]  # (T, S)
        if window is not None:
            visible &= keys[None, :] > cache_positions[:, None] - window
        return PreparedAttention(
            kernel, "decode", window, mask=visible[None, None], cache_positions=cache_positions
        )
    B, T = shape
    if documents is None:
        if window is None or kernel in ("segmented", "mask"):  # the mask kernel applies the window itself
            return PreparedAttention(kernel, "causal", window)
        # A document kernel applies the window: each row is one document of the joined row.
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32).to(device, non_blocking=True)
        prepared = prepare(kernel, (1, B * T), device, Documents(cu_seqlens, T), window)
        prepared.rows_as_documents = True
        return prepared
    prepared = PreparedAttention(kernel, "documents", window, documents=documents)
    if kernel == "varlen":
        prepared.varlen_attn = _varlen_attn()
        prepared.varlen_features = frozenset(varlen_features(prepared.varlen_attn))
    elif kernel == "segmented":
        # The CPU's kernel plans on the host (free there). The mask kernel does not: reading the boundaries
        # would make the host wait for a GPU every forward pass, so its query chunks are bounded by the
        # window alone (their mask rows still keep documents apart).
        prepared.segments = document_lengths(documents)
    elif kernel == "flex":
        prepared.block_mask = _document_block_mask(token_document_ids(documents, T), window)
    return prepared


def document_mask(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask for document_ids (T,) or (B, T): causal within each document (and
    within the window), True where a query may attend. T x T: for counting and checking (the attention FLOPs,
    the tests); attention builds the rows of one query chunk at a time (`visible_keys`)."""
    if document_ids.dim() == 1:
        document_ids = document_ids[None]
    T = document_ids.shape[1]
    return visible_keys(0, T, 0, window, document_ids, document_ids.device)[:, None]


def visible_keys(
    start: int,
    end: int,
    first: int,
    window: int | None,
    document_ids: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean (end - start, end - first) mask rows of queries [start, end) over keys [first, end), True where
    a query may attend: causal, within the window, and, given document_ids (N,) or (B, N) of every token of
    the row, within the query's document ((B, end - start, end - first) for (B, N) ids)."""
    queries = torch.arange(start, end, device=device)[:, None]
    keys = torch.arange(first, end, device=device)[None, :]
    visible = keys <= queries
    if window is not None:
        visible &= keys > queries - window
    if document_ids is not None:
        visible = visible & (document_ids[..., start:end, None] == document_ids[..., None, first:end])
    return visible


FLEX_BLOCK = 128
"""flex_attention's block size (torch's default): the block mask says, per 128 x 128 block of queries and
keys, whether the block is skipped, computed in full, or computed with the mask applied per position."""


def _document_block_mask(document_ids: torch.Tensor, window: int | None) -> Any:
    """flex_attention's BlockMask for causal attention within each document (and the window) of one row of N
    tokens, worked out on the device from the documents' first and last tokens in each block: (N/128)^2
    work and memory, where `create_block_mask` evaluates the mask at all N^2 positions (materializing them
    unless compiled: 2 GiB of int64 document-id pairs for a row of 16k tokens). The same blocks as
    create_block_mask's (tests/test_model_network_attention.py compares them); the per-position mask of partial blocks is
    applied by flex_attention with the same function."""
    from torch.nn.attention.flex_attention import BlockMask

    def document_causal(batch: Any, head: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        visible = (document_ids[query] == document_ids[key]) & (query >= key)
        return visible & (query - key < window) if window is not None else visible

    N, device = document_ids.shape[0], document_ids.device
    first = torch.arange(0, N, FLEX_BLOCK, device=device)  # (NB,) each block's first token
    last = (first + FLEX_BLOCK).clamp(max=N) - 1  # (NB,) and its last
    first_doc, last_doc = document_ids[first], document_ids[last]  # documents run in order along the row
    blocks = torch.arange(first.shape[0], device=device)
    below = blocks[None, :] < blocks[:, None]  # (query block, key block): every key before every query
    diagonal = blocks[None, :] == blocks[:, None]
    # Below the diagonal a query block and a key block share a document only if the key block's last
    # document is the query block's first; every pair is visible only if that is the one document of both.
    shared = below & (last_doc[None, :] == first_doc[:, None])
    one_document = (first_doc == last_doc)[None, :] & (first_doc == last_doc)[:, None]
    complete = (last - first + 1 == FLEX_BLOCK)[:, None]  # a padded block (the row's last) is never full
    any_visible, all_visible = diagonal | shared, shared & one_document & complete
    if window is not None:
        # The closest pair of a shared document: the query block's first token, the key block's last.
        any_visible &= diagonal | (first[:, None] - last[None, :] < window)
        all_visible &= last[:, None] - first[None, :] < window
    partial = any_visible & ~all_visible

    def as_kv_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """How many key blocks each query block has, and their indices first (as create_block_mask orders)."""
        order = torch.sort(dense.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return dense.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *as_kv_blocks(partial), *as_kv_blocks(all_visible), BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=document_causal, seq_lengths=(N, N),
    )  # fmt: skip


# ---- the one function --------------------------------------------------------------------------------------
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedAttention,
    dropout: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, K, S, D) as `prepared` says -> (B, T, H, D).

    K may divide H (grouped-query attention): every kernel serves each kv head to H // K query heads.
    `scale` multiplies the scores (None: 1/sqrt(D)); `softcap` c, when set, caps them smoothly to
    c * tanh(score / c) before the softmax (Gemma 2). Soft-capping runs in flex's score_mod on the flex
    kernel and as explicit masked attention everywhere else (varlen and SDPA's fused kernels cannot apply it).
    `sinks` (H,), when set, are each head's sink logit: one more term exp(sink) in every softmax's denominator,
    with no value (gpt-oss); they run as explicit masked attention only (`kernel_for_sinks`).

    With `prepared.context`, q, k, v hold this rank's t = T/N tokens: an all-to-all gives it every token of H/N
    query heads (and their kv heads), the kernel attends over whole sequences, another gives the tokens back.
    """
    context = prepared.context
    if context is None:
        return _attend(q, k, v, prepared, dropout, scale, softcap, sinks)
    q = heads_from_tokens(q, context)  # (B, H/N, T, D)
    k, v = (heads_from_tokens(kv_heads_for_context(x, context), context) for x in (k, v))
    if sinks is not None:  # this rank's heads' sinks
        sinks = sinks.chunk(context.size)[context.rank]
    return tokens_from_heads(
        _attend(q, k, v, prepared, dropout, scale, softcap, sinks), context
    )  # (B, t, H, D)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedAttention,
    dropout: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if prepared.rows_as_documents:
        B, H, T, D = q.shape
        joined = (x.transpose(1, 2).reshape(1, B * T, x.shape[1], D).transpose(1, 2) for x in (q, k, v))
        return _attend_documents(*joined, prepared, dropout, scale, softcap, sinks).reshape(B, T, H, D)
    written_out = softcap is not None or sinks is not None  # what the fused kernels cannot apply
    if prepared.pattern == "decode":  # a few queries: their (T, S) mask is small
        if written_out:
            return written_out_attention(q, k, v, prepared.mask, dropout, scale, softcap, sinks)
        return _sdpa(q, k, v, prepared.mask, dropout, scale)
    if prepared.pattern == "causal":
        if not written_out and q.device.type == "cpu":
            return chunked_causal_attention(q, k, v, dropout, prepared.window, scale).transpose(1, 2)
        if not written_out and prepared.window is None:
            return _sdpa(q, k, v, None, dropout, scale)
        return chunked_attention(q, k, v, prepared, dropout, scale, softcap, sinks)
    return _attend_documents(q, k, v, prepared, dropout, scale, softcap, sinks)


def _attend_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedAttention,
    dropout: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if prepared.kernel == "flex" and sinks is None:
        return _flex(q, k, v, prepared, scale, softcap)
    if softcap is not None or sinks is not None or prepared.kernel == "mask":
        return chunked_attention(q, k, v, prepared, dropout, scale, softcap, sinks)
    if prepared.kernel == "segmented":
        return segmented_attention(q, k, v, prepared.segments, dropout, prepared.window, scale)
    return _varlen(q, k, v, prepared, scale)


def written_out_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention written out, for what the fused kernels cannot apply: q (B, H, T, D), k, v (B, K, S, D), mask
    (B or 1, 1, T, S) True where a query may attend -> (B, T, H, D). The scores are soft-capped when `softcap`
    is set (Gemma 2); each head's sink logit (H,) joins the softmax as one more column, dropped after it, when
    `sinks` are set (gpt-oss, transformers' eager_attention_forward). Materializes the (B, H, T, S) scores: for
    a few queries (decoding) or one chunk of them (`chunked_attention`)."""
    B, H, T, D = q.shape
    K = k.shape[1]
    # Grouped-query attention without repeating the kv heads: the H // K query heads of a kv head are
    # stacked along the queries, (B, K, H // K * T, D), and the mask broadcast over them.
    grouped = q.reshape(B, K, H // K * T, D)
    scores = (grouped @ k.transpose(-2, -1)).float() * (scale if scale is not None else D**-0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.view(B, K, H // K, T, -1).masked_fill(~mask[:, :, None], float("-inf"))  # (B, K, G, T, S)
    if sinks is None:
        probabilities = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, K, H // K, 1, 1).expand(B, K, H // K, T, 1)
        probabilities = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # (B, K, G, T, S)
    weights = F.dropout(probabilities, dropout).to(v.dtype)
    return (weights.view(B, K, H // K * T, -1) @ v).view(B, H, T, D).transpose(1, 2)


SCORES_PER_CHUNK = 2**25
"""The scores (batch x heads x queries x keys) of one query chunk in `chunked_attention`: 128 MiB in fp32.
Soft-capped attention keeps a few tensors of that size alive at once in its forward and backward passes
(scores, capped scores, weights, their gradients), so a chunk stays under about a GiB whatever the row's
length, while a chunk still holds enough queries (1024 for 2 heads over 16k keys) that the per-chunk calls
cost little next to their matmuls."""
MIN_QUERY_CHUNK = 64
"""Queries of a chunk at least, however many heads and keys: each chunk's matmuls stay large next to the
fixed cost of a call (and the memory is still linear in the keys)."""


def query_chunk(batch_heads: int, keys: int) -> int:
    """Queries per chunk for `batch_heads` rows of scores over `keys` keys: SCORES_PER_CHUNK at most, in
    multiples of MIN_QUERY_CHUNK."""
    return max(MIN_QUERY_CHUNK, SCORES_PER_CHUNK // (batch_heads * keys) // MIN_QUERY_CHUNK * MIN_QUERY_CHUNK)


@torch.compiler.disable
def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedAttention,
    dropout: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (B, H, T, D) over k, v (B, K, T, D) a chunk of queries at a time -> (B, T, H, D):
    written out (`written_out_attention`) when softcap or sinks are set, else SDPA with the chunk's mask rows.

    Plain causal rows or one row (B = 1) of documents, as `prepared` says, with its window. Queries [a, b)
    only need keys [f, b), f = 0, or a - window + 1 with a window; their mask rows are built for those keys
    alone (`visible_keys`), from each token's document (`token_document_ids`), which keeps documents apart.
    The keys are not bounded by a's document: that would read the boundaries on the host, a wait for a GPU
    every forward pass (the kernels that reach here, the mask kernel and the written-out soft-capped and
    sink paths, plan nothing on the host). Each chunk's scores stay under SCORES_PER_CHUNK (`query_chunk`), and while
    training every chunk is recomputed in the backward pass (`torch.utils.checkpoint`, which replays its
    dropout), so that only q, k, v and the output are kept: memory linear in T, not T x T. A lone chunk (a
    short row) is not: its scores are within the bound already, and it saves the recomputation.

    Run eagerly under torch.compile (`torch.compiler.disable`: a graph break). Traced with dynamic shapes,
    the loop unrolls into a checkpointed region per chunk, compiled anew for each number of chunks (five
    row lengths of 4 to 16 chunks took over 10 minutes to compile on a 2-core CPU, against seconds behind
    the break).
    """
    B, H, T, D = q.shape
    chunk = min(T, query_chunk(B * H, T))
    window, documents, document_ids = prepared.window, prepared.documents, None
    if prepared.pattern == "documents":
        assert documents is not None
        document_ids = token_document_ids(documents, T)
    recompute = T > chunk and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outputs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        first = 0 if window is None else max(0, start - window + 1)
        pieces = (q[:, :, start:end], k[:, :, first:end], v[:, :, first:end])
        options = (start, first, document_ids, window, dropout, scale, softcap, sinks)
        if recompute:
            outputs.append(
                checkpoint(
                    _attend_chunk, *pieces, *options, use_reentrant=False, preserve_rng_state=dropout > 0
                )
            )
        else:
            outputs.append(_attend_chunk(*pieces, *options))
    return torch.cat(outputs, dim=1)


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    first: int,
    document_ids: torch.Tensor | None,
    window: int | None,
    dropout: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries [start, start + q's length) of `chunked_attention` over keys [first, ...) -> (B, T, H, D)."""
    end = start + q.shape[2]
    mask = visible_keys(start, end, first, window, document_ids, q.device)[None, None]
    if softcap is not None or sinks is not None:
        return written_out_attention(q, k, v, mask, dropout, scale, softcap, sinks)
    return _sdpa(q, k, v, mask, dropout, scale)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA, causal when there is no mask -> (B, T, H, D)."""
    H, K = q.shape[1], k.shape[1]
    # The kernels that take an explicit mask on a GPU (memory-efficient attention) do not do the
    # grouping themselves: repeat the kv heads for them.
    grouped = K != H and (mask is None or q.device.type == "cpu")
    if K != H and not grouped:
        k = k.repeat_interleave(H // K, dim=1)
        v = v.repeat_interleave(H // K, dim=1)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scale, enable_gqa=grouped
    )
    return y.transpose(1, 2)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype the flash kernels run in: autocast's (RoPE leaves q and k in fp32 under autocast)."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return q.dtype


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: PreparedAttention, scale: float | None
) -> torch.Tensor:
    """Flash attention per document: q (1, H, N, D), k, v (1, K, N, D) -> (1, N, H, D)."""
    varlen_attn, features, documents = prepared.varlen_attn, prepared.varlen_features, prepared.documents
    assert varlen_attn is not None and documents is not None
    H, K = q.shape[1], k.shape[1]
    dtype = _compute_dtype(q)
    query, key, value = (x[0].transpose(0, 1).to(dtype) for x in (q, k, v))  # (N, H or K, D)
    options: dict[str, Any] = {}
    if scale is not None and "scale" in features:
        options["scale"] = scale
    elif scale is not None:  # the same scores as under the default 1/sqrt(D)
        query = query * (scale * query.shape[-1] ** 0.5)
    if "window_size" in features:
        # flash's window counts the keys left of the query; transformers' window counts the query too.
        options["window_size"] = (-1 if prepared.window is None else prepared.window - 1, 0)
    else:
        options["is_causal"] = True
    if K != H:
        if "enable_gqa" in features:
            options["enable_gqa"] = True
        else:
            key, value = (x.repeat_interleave(H // K, dim=1) for x in (key, value))
    y = varlen_attn(
        query, key, value, documents.cu_seqlens, documents.cu_seqlens, documents.max_seqlen,
        documents.max_seqlen, **options,
    )  # fmt: skip
    return y[None]  # (1, N, H, D)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedAttention,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if softcap is not None:

        def score_mod(score: torch.Tensor, batch: Any, head: Any, query: Any, key: Any) -> torch.Tensor:
            return softcap * torch.tanh(score / softcap)

    dtype = _compute_dtype(q)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    # Outside a compiled region flex_attention runs unfused (and materializes the scores): compile it.
    function = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    y = function(
        q, k, v, score_mod, block_mask=prepared.block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return y.transpose(1, 2)


_COMPILED_FLEX: list[Any] = []


def _compiled_flex_attention() -> Any:
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED_FLEX[0]


# ---- the CPU: one document at a time ---------------------------------------------------------------------
def document_lengths(documents: Documents) -> list[int]:
    """The lengths of the documents of a joined row, read on the host (for the CPU, where that costs nothing):
    `segmented_attention` cuts the row into them."""
    return torch.diff(documents.cu_seqlens.cpu()).tolist()


def segmented_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int] | None,
    dropout: float,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each document of one row: q (1, H, N, D), k, v (1, K, N, D) -> (1, N, H, D).

    Documents are consecutive in the row, so each one is a view (`split`): no gather, and no scatter in the
    backward pass. Attending to each one alone costs the sum of squared document lengths; grouping documents
    of similar length into padded batches (fewer kernel calls) measured 3-8% slower per step here, the
    gathers and their backward costing more than the calls they saved.
    """
    assert lengths is not None
    pieces = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
    outputs = [chunked_causal_attention(qd, kd, vd, dropout, window, scale) for qd, kd, vd in pieces]
    return torch.cat(outputs, dim=2).transpose(1, 2)


QUERY_CHUNK = 96
"""Queries per SDPA call in `chunked_causal_attention` (measured best on the CPU for head_dim 32, 1 thread)."""


def chunked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal SDPA of q (n, H, L, D) over k, v (n, K, L, D), a chunk of queries at a time -> (n, H, L, D).

    The CPU flash kernel computes every score of an L x L block, masked or not (causal is no faster than
    full attention there). Queries [a, b) only need keys [0, b) (or [a - window + 1, b) with a window):
    in c chunks that is (c + 1) / 2c of the work, 20-30% less time for L = 256-512
    (tests/test_model_network_attention.py checks the result against one call).
    """
    L = q.shape[2]
    chunks = -(-L // QUERY_CHUNK)
    grouped = k.shape[1] != q.shape[1]
    if chunks == 1 and (window is None or window >= L):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=grouped
        )
    bounds = [L * j // chunks for j in range(chunks + 1)]
    outputs = []
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    for start, end, q_chunk in zip(bounds, bounds[1:], q.split(sizes, dim=2)):
        first = 0 if window is None else max(0, start - window + 1)
        mask = visible_keys(start, end, first, window, None, q.device)  # the lower-right causal mask
        outputs.append(
            F.scaled_dot_product_attention(
                q_chunk,
                k[:, :, first:end],
                v[:, :, first:end],
                attn_mask=mask,
                dropout_p=dropout,
                scale=scale,
                enable_gqa=grouped,
            )  # fmt: skip
        )
    return torch.cat(outputs, dim=2)
