"""litsft/model/network/loss.py: the chunked cross-entropy equals F.cross_entropy summed over the full logits, in value and
gradients, with and without soft-capping and logit scaling (`output_logits`, which the model's `logits` uses
too), whatever the chunk size, eager and compiled; chunks are sized by memory. (The model's use of it, the head
run on the labelled positions only, is in tests/test_model_network_transformer.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from litsft.model.network.loss import chunked_cross_entropy, loss_chunk_tokens, output_logits

TOKENS, HIDDEN, VOCAB = 37, 8, 11


def head_hidden_and_labels(
    tokens: int = TOKENS, seed: int = 0
) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator) * 3)  # logits beyond a small cap
    hidden = torch.randn(tokens, HIDDEN, generator=generator, requires_grad=True)
    labels = torch.randint(0, VOCAB, (tokens,), generator=generator)
    labels[::4] = -100  # positions without a loss
    return head, hidden, labels


def reference(
    head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None, scaling: float = 1.0
):
    """The full (N, V) logits, divided by `scaling`, capped as c * tanh(logit / c), summed cross-entropy over
    the labelled tokens."""
    logits = head(hidden) / scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk_size", [5, TOKENS, 2048])  # several chunks with a short last one, one, one
def test_summed_loss_and_gradients_equal_the_full_logits(chunk_size: int, softcap: float | None) -> None:
    head, hidden, labels = head_hidden_and_labels()
    expected = reference(head, hidden, labels, softcap)
    expected_grads = torch.autograd.grad(expected, (hidden, head.weight))
    loss = chunked_cross_entropy(hidden, head, labels, chunk_size=chunk_size, softcap=softcap)
    grads = torch.autograd.grad(loss, (hidden, head.weight))
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("softcap", "scaling"), [(None, 1.0), (2.0, 1.5)])
@pytest.mark.parametrize("chunk_size", [5, 2048])
def test_one_sum_per_segment_equals_each_rows_cross_entropy_of_the_full_logits(
    chunk_size: int, softcap: float | None, scaling: float
) -> None:
    """`segments`: each segment's summed cross-entropy (minus its log-probability), against per-row
    F.cross_entropy on the full logits added up by segment, values and gradients (segment 3 has no row, and
    segment 2's rows are all unlabelled: both 0)."""
    head, hidden, labels = head_hidden_and_labels()
    segments = torch.tensor([0] * 9 + [1] * 11 + [2] * 4 + [4] * 13)
    labels[20:24] = -100
    logits = head(hidden) / scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_row = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    expected = torch.zeros(5).index_add(0, segments, per_row)
    weights = torch.arange(1.0, 6.0)  # a different weight per segment, so that each one's gradient counts
    expected_grads = torch.autograd.grad((expected * weights).sum(), (hidden, head.weight))
    sums = chunked_cross_entropy(
        hidden, head, labels, chunk_size=chunk_size, softcap=softcap, scaling=scaling, segments=segments,
        num_segments=5,
    )  # fmt: skip
    assert sums.shape == (5,) and sums.dtype == torch.float32 and sums[2] == 0 and sums[3] == 0
    torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        sums.sum(), reference(head, hidden, labels, softcap, scaling), atol=1e-5, rtol=1e-6
    )
    grads = torch.autograd.grad((sums * weights).sum(), (hidden, head.weight))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_scaled_logits_give_the_loss_of_the_scaled_full_logits(softcap: float | None) -> None:
    """Granite's logits_scaling (logits divided by it, before any cap), in chunks, equals the full logits'."""
    head, hidden, labels = head_hidden_and_labels()
    expected = reference(head, hidden, labels, softcap, scaling=8.0)
    loss = chunked_cross_entropy(hidden, head, labels, chunk_size=5, softcap=softcap, scaling=8.0)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)
    assert not torch.allclose(
        loss, chunked_cross_entropy(hidden, head, labels, chunk_size=5, softcap=softcap)
    )
    with torch.no_grad():
        assert torch.equal(
            output_logits(head(hidden), 8.0, softcap), reference_logits(head, hidden, 8.0, softcap)
        )


def reference_logits(
    head: nn.Linear, hidden: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    logits = head(hidden) / scaling
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def test_softcap_changes_the_loss() -> None:
    """The cap is applied (logits of the test head reach beyond 2), not ignored."""
    head, hidden, labels = head_hidden_and_labels()
    capped = chunked_cross_entropy(hidden, head, labels, chunk_size=5, softcap=2.0)
    assert not torch.allclose(capped, chunked_cross_entropy(hidden, head, labels, chunk_size=5))


def test_no_labelled_token_gives_zero() -> None:
    head, hidden, labels = head_hidden_and_labels()
    nothing = torch.full_like(labels, -100)
    assert chunked_cross_entropy(hidden, head, nothing, chunk_size=5).item() == 0.0
    assert chunked_cross_entropy(hidden, head, nothing, chunk_size=TOKENS).item() == 0.0


def test_bf16_hidden_states_give_an_fp32_loss() -> None:
    """The logits are upcast before the softmax: a bf16 head's loss is the fp32 loss of its bf16 logits."""
    head, hidden, labels = head_hidden_and_labels()
    head, hidden = head.to(torch.bfloat16), hidden.detach().to(torch.bfloat16)
    loss = chunked_cross_entropy(hidden, head, labels, chunk_size=5)
    expected = F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "budget", "tokens"),
    [
        (32000, torch.bfloat16, 2**30, 2048),  # Llama 2: 2**30 / (32000 * (2 + 12)) = 2396.6
        (128256, torch.bfloat16, 2**30, 512),  # Llama 3: 597.9
        (151936, torch.bfloat16, 2**30, 256),  # Qwen 2.5: 504.8
        (32000, torch.float32, 2**30, 2048),  # fp32 logits: 4 + 12 bytes, 2097.2
        (32000, torch.bfloat16, 2**20, 2),  # 2.3
        (32000, torch.bfloat16, 2**10, 1),  # a budget under one token's logits still makes progress
    ],
)
def test_loss_chunks_are_the_largest_power_of_two_that_fits_the_budget(vocab_size, dtype, budget, tokens):
    assert loss_chunk_tokens(vocab_size, dtype, budget) == tokens


def test_compiled_chunks_equal_eager_ones_and_compile_once() -> None:
    """The path a compiled model takes (`compiled=True`: each chunk's cast and cross-entropy through
    torch.compile) gives the eager loss and gradients. Compiled on the first chunk of the first batch (10
    tokens: chunks of 4, 4, 2), it runs the next batch's chunks of 4 and 3 without recompiling (dynamic
    shapes)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for seed, tokens in enumerate((10, 7)):
        results = []
        for compiled in (False, True):
            head, hidden, labels = head_hidden_and_labels(tokens, seed)
            with torch._dynamo.config.patch(error_on_recompile=compiled and seed > 0):
                loss = chunked_cross_entropy(hidden, head, labels, chunk_size=4, compiled=compiled)
                results.append((loss, *torch.autograd.grad(loss, (hidden, head.weight))))
        for name, value, reference_value in zip(("loss", "hidden grad", "head grad"), *results):
            torch.testing.assert_close(value, reference_value, msg=name)
    assert counters["stats"]["unique_graphs"] == 1  # it did run compiled, as one graph
    torch._dynamo.reset()
