"""Mixture-of-experts MLP on the CPU: litsft's experts (assignments sorted by expert, one matmul per expert over
its slice) against transformers' eager experts (a loop over the experts hit, each gathering its tokens with a
one-hot mask), forward and backward, and torch._grouped_mm's CPU kernel over the same sorted slices.

python benchmarks/bench_moe_cpu.py [--tokens 1024] [--repeats 5]

One MoE layer of OLMoE's routing (64 experts, 8 per token) at half its width (hidden 1024, expert 512), fp32,
one thread, the same routing and weights for every implementation; each is timed `repeats` times, alternating,
and the median is printed. The outputs are checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import machine_description
from transformers import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

from litsft.model.network.moe import GroupedExperts, route

EXPERTS, PER_TOKEN, HIDDEN, INTERMEDIATE = 64, 8, 1024, 512


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ours = GroupedExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    theirs = OlmoeExperts(
        OlmoeConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS)
    )
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(args.tokens, HIDDEN)
    weights, chosen, _ = route(x @ torch.randn(EXPERTS, HIDDEN).T, PER_TOKEN, normalize=False)
    counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)

    def litsft_experts(grouped: bool = False) -> torch.Tensor:
        if not grouped:
            return ours(x, chosen, weights, counts)
        order = chosen.flatten().argsort(stable=True)
        out = ours._grouped(x[order // PER_TOKEN], counts) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, order // PER_TOKEN, out)

    runs = {
        "litsft (sorted, a matmul per expert)": litsft_experts,
        "torch._grouped_mm (CPU kernel)": lambda: litsft_experts(grouped=True),
        "transformers eager (loop, one-hot masks)": lambda: theirs(x, chosen, weights),
    }
    reference = runs["transformers eager (loop, one-hot masks)"]()
    for name, run in runs.items():
        assert (run() - reference).abs().max() < 1e-4, name
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            for module in (ours, theirs):
                module.zero_grad()
            start = time.perf_counter()
            run().square().sum().backward()
            seconds[name].append(time.perf_counter() - start)
    print(machine_description())
    print(
        f"{EXPERTS} experts, {PER_TOKEN} per token, hidden {HIDDEN}, expert {INTERMEDIATE}, {args.tokens} tokens, "
        f"fp32, 1 thread, forward + backward, median of {args.repeats}"
    )
    base = statistics.median(seconds["transformers eager (loop, one-hot masks)"])
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"{name:<45}{median * 1000:>9.1f} ms{base / median:>7.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args())
