"""A named config at tiny widths, for tests that compare counts or activations family by family."""

from __future__ import annotations

import dataclasses

from litsft.model.config import Config


def tiny_shape(config: Config) -> Config:
    """`config`'s block features (biases, q/k norms, norms, partial rotary, tying, GQA ratio, an explicit
    head_dim, its first two layer types) at tiny widths: 2 layers, 2 kv heads, a vocabulary of 96.
    LongRoPE's factors fit the published head width only, so RoPE scaling is dropped (it has no parameters).
    A mixture of experts keeps 4 experts, 2 per token (24 wide where they have their own width), and a shared
    expert 40 wide where it has one."""
    group = config.num_heads // config.num_kv_heads
    return dataclasses.replace(
        config,
        num_layers=2,
        layer_types=config.layer_types[:2] if config.layer_types else None,
        num_kv_heads=2,
        num_heads=2 * group,
        hidden_size=32 * group,
        head_dim=16 if config.head_dim != config.hidden_size // config.num_heads else 0,
        intermediate_size=48,
        vocab_size=96,
        rope_scaling=None,
        **(
            dict(
                num_experts=4,
                experts_per_token=2,
                expert_intermediate_size=24,
                shared_expert_intermediate_size=40 if config.shared_expert_intermediate_size else 0,
            )
            if config.num_experts
            else {}
        ),
    )
