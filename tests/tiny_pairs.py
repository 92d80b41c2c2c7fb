"""What the preference objectives' tests share: random scores of pairs of replies, and the tiny model they
score with."""

from __future__ import annotations

import torch

from litsft.model.config import Config
from litsft.model.network.transformer import Transformer
from litsft.training.objectives.preference import PairScores


def random_scores(pairs: int = 16, seed: int = 0, reference: bool = True, closest: float = 0.2) -> PairScores:
    """Summed log-probabilities of replies of 1 to 30 tokens (from -`closest` to -3 a token), float64, that
    carry a gradient, under the model and, with `reference`, a reference near it."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 31, (2, pairs), generator=generator).double()
    per_token = -closest - (3 - closest) * torch.rand(2, pairs, generator=generator, dtype=torch.float64)
    near = per_token + 0.3 * torch.randn(2, pairs, generator=generator, dtype=torch.float64)
    logps = (per_token * tokens).requires_grad_()
    if not reference:
        return PairScores(logps[0], logps[1], tokens[0], tokens[1])
    return PairScores(logps[0], logps[1], tokens[0], tokens[1], near[0] * tokens[0], near[1] * tokens[1])


def tiny_llama() -> Transformer:
    """The tiny Llama, seeded, on one thread (its per-sequence scores are compared to 1e-5)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(Config.from_name("tiny-llama"))
    model.init_weights(0)
    return model
