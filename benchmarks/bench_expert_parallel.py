"""Expert parallelism's dispatch against all-gathering every expert: bytes each rank moves in a step, and time.

python benchmarks/bench_expert_parallel.py [--tokens 1024] [--repeats 5] [--skew 0]

One MoE layer of OLMoE's routing (64 experts, 8 per token) at half its width (hidden 1024, expert 512; 100.7M
expert parameters, 403 MB in fp32), on 2 gloo processes of one thread each, `--tokens` tokens per rank,
forward and backward, fp32, litsft's GroupedExperts in both arms:

- all-gather: the experts sharded by FSDP2 over both ranks (`fully_shard`, as a block's experts are without
  expert parallelism): each step all-gathers every expert in forward and again in backward, and
  reduce-scatters their gradients;
- expert parallel: each rank owns 32 whole experts (`shard_experts`, as `--parallel.expert 2` does) and each
  assignment travels to its expert's rank and back (`dispatch`, `combine`), forward and backward.

Bytes are what one rank sends to the other per step: for the all-gather arm its shard in each all-gather and
the half of the gradients it reduce-scatters (from the parameters' sizes, as FSDP2 moves them); for the
expert-parallel arm the rows each `dispatch` and `combine` actually sent off-rank for this routing (read from
the exchange), twice (the backward sends the gradients of the same rows back the other way), plus the (E,)
counts. `--skew S` adds S to the router's logits of rank 0's experts, so that it receives most assignments.
Each arm runs `repeats` timed steps after one warm-up; the median is printed. The expert-parallel arm's
output and gradients are checked against the all-gather arm's first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import free_port, machine_description
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from litsft.model.network import moe as moe_module
from litsft.model.network.expert_parallel import ExpertShard, shard_experts
from litsft.model.network.moe import GroupedExperts, route

EXPERTS, PER_TOKEN, HIDDEN, INTERMEDIATE = 64, 8, 1024, 512
WORLD = 2
FLOAT_BYTES = 4


def routed_tokens(rank: int, tokens: int, skew: float) -> tuple[torch.Tensor, ...]:
    """This rank's tokens (T, C) and their routing: one router for every rank, different tokens on each."""
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0)) / HIDDEN**0.5
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1 + rank))
    logits = x @ router.T
    logits[:, : EXPERTS // WORLD] += skew  # rank 0's experts
    weights, chosen, _ = route(logits, PER_TOKEN, normalize=True)
    return x, chosen, weights, torch.bincount(chosen.flatten(), minlength=EXPERTS)


def step(
    experts: GroupedExperts, x: torch.Tensor, chosen, weights, counts
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward; the output and the input's gradient."""
    inputs = x.clone().requires_grad_(True)
    out = experts(inputs, chosen, weights, counts)
    out.square().mean().backward()
    return out.detach(), inputs.grad


def timed(experts: GroupedExperts, batch: tuple, repeats: int) -> list[float]:
    step(experts, *batch)  # warm-up
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        step(experts, *batch)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return seconds


def worker(rank: int, port: int, args: argparse.Namespace, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    batch = routed_tokens(rank, args.tokens, args.skew)

    torch.manual_seed(0)
    gathered = GroupedExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    whole = {name: p.detach().clone() for name, p in gathered.named_parameters()}
    fully_shard(gathered, mesh=mesh, reshard_after_forward=True)  # as FULL_SHARD shards a block's experts
    reference = step(gathered, *batch)
    gathered_seconds = timed(gathered, batch, args.repeats)
    expert_parameters = sum(t.numel() for t in whole.values())
    # Each all-gather sends this rank's half to the other; the reduce-scatter sends it the other half's sums.
    gathered_bytes = 3 * expert_parameters // WORLD * FLOAT_BYTES

    parallel = GroupedExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    parallel.load_state_dict(whole)
    shard_experts(parallel, ExpertShard(mesh.get_group(), rank, WORLD), mesh)
    exchanges = []
    original = moe_module.dispatch

    def recording(*args_, **kwargs):
        rows, row_counts, exchange = original(*args_, **kwargs)
        exchanges.append(exchange)
        return rows, row_counts, exchange

    moe_module.dispatch = recording
    try:
        out, grad = step(parallel, *batch)
        parallel_seconds = timed(parallel, batch, args.repeats)
    finally:
        moe_module.dispatch = original
    exchange = exchanges[0]
    off_rank = sum(n for r, n in enumerate(exchange.sent) if r != rank) + sum(
        n for r, n in enumerate(exchange.received) if r != rank
    )
    parallel_bytes = 2 * off_rank * HIDDEN * FLOAT_BYTES + EXPERTS * 8
    difference = max((out - reference[0]).abs().max().item(), (grad - reference[1]).abs().max().item())
    results[rank] = {
        "gathered_s": statistics.median(gathered_seconds),
        "parallel_s": statistics.median(parallel_seconds),
        "gathered_bytes": gathered_bytes,
        "parallel_bytes": parallel_bytes,
        "received_rows": sum(exchange.received),
        "assignments": args.tokens * PER_TOKEN,
        "difference": difference,
        "expert_parameters": expert_parameters,
    }
    dist.destroy_process_group()


def main(args: argparse.Namespace) -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(free_port(), args, results), nprocs=WORLD, join=True)
    print(machine_description())
    first = results[0]
    print(
        f"{EXPERTS} experts, {PER_TOKEN} per token, hidden {HIDDEN}, expert {INTERMEDIATE} "
        f"({first['expert_parameters'] / 1e6:.1f}M expert parameters), {WORLD} gloo processes x 1 thread, "
        f"{args.tokens} tokens per rank, skew {args.skew}, fp32, forward + backward, median of {args.repeats}"
    )
    for rank in range(WORLD):
        r = results[rank]
        print(
            f"rank {rank}: receives {r['received_rows']:,} rows for its experts ({r['assignments']:,} assignments "
            f"sent); expert parallel vs all-gather, largest difference in output and input gradient {r['difference']:.1e}"
        )
    print(f"{'arm':<18}{'MB sent/rank/step':>19}{'seconds/step':>14}")
    gathered_mb = max(results[r]["gathered_bytes"] for r in range(WORLD)) / 1e6
    parallel_mb = max(results[r]["parallel_bytes"] for r in range(WORLD)) / 1e6
    gathered_s = max(results[r]["gathered_s"] for r in range(WORLD))
    parallel_s = max(results[r]["parallel_s"] for r in range(WORLD))
    print(f"{'all-gather':<18}{gathered_mb:>19.1f}{gathered_s:>14.3f}")
    print(f"{'expert parallel':<18}{parallel_mb:>19.1f}{parallel_s:>14.3f}")
    per_token = parallel_mb / args.tokens
    print(
        f"expert parallel / all-gather: {parallel_mb / gathered_mb:.2f}x the bytes, {parallel_s / gathered_s:.2f}x "
        f"the time (the busier rank's); its bytes grow with the tokens ({per_token * 1e3:.1f} kB a token here), "
        f"the all-gather's do not: equal at about {gathered_mb / per_token:,.0f} tokens per rank"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--skew", type=float, default=0.0, help="added to the router logits of rank 0's experts"
    )
    main(parser.parse_args())
