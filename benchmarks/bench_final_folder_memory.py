"""Rank 0's peak memory writing the final model folder from a sharded model: litsft's gather vs DCP's
consolidation.

    python benchmarks/bench_final_folder_memory.py [--hidden 768 --layers 12 --ranks 2 4]

Two (or --ranks) processes (gloo, forked) hold bench_load_memory.py's model (~113M parameters, fp32) sharded by FSDP2
(FULL_SHARD). Each method runs in a fresh pair of processes and reports rank 0's peak RSS growth while
writing bf16 weights:
  gather        one full tensor at a time gathered to rank 0, which streams it into `save_model_folder`'s
                safetensors files (how litsft wrote every run's final/ before)
  consolidate   `save_model_folder_from_ranks` (how it writes it now): every rank writes its bf16 parts with
                DCP's `HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`, and DCP merges
                them into whole tensors on rank 0, which then reads them back for the manifest's fingerprint
Checks that both wrote the same tensors; prints the figures; asserts nothing else. glibc is told to return
freed memory (MALLOC_MMAP_THRESHOLD_), as in bench_load_memory.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from harness import machine_description


def rank_main(rank: int, ranks: int, method: str, shape: tuple[int, int], work: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from litsft.checkpoint.model_folder import save_model_folder, save_model_folder_from_ranks
    from litsft.model.network.transformer import Transformer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{work}/init-{method}-{ranks}", rank=rank, world_size=ranks
    )
    config = model_config(*shape)
    with torch.device("meta"):  # as the engine builds it: no rank ever holds the whole model
        model = Transformer(config)
    mesh = init_device_mesh("cpu", (ranks,))
    for unit in (*model.blocks, model):  # as litsft.training.parallel shards it under FULL_SHARD
        fully_shard(unit, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)  # the same weights for both methods
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.barrier()
    start = time.perf_counter()
    out = Path(work) / f"{method}-{ranks}"
    if method == "gather":
        dtype = getattr(torch, config.torch_dtype)
        gathered = (
            (name, (t.full_tensor() if isinstance(t, DTensor) else t).to(dtype))
            for name, t in model.state_dict().items()
        )
        if rank == 0:
            save_model_folder(gathered, config, out)
        else:
            for _ in gathered:  # take part in every gather
                pass
    else:
        save_model_folder_from_ranks(model, out, config, None)
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results.put((rank, (peak - before, time.perf_counter() - start)))
    dist.destroy_process_group()


def model_config(hidden: int, layers: int):  # noqa: ANN201
    from litsft.model.config import Config

    return Config.from_name("tiny-llama", vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                            num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 128,
                            torch_dtype="bfloat16")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":  # glibc reads it once, at process start
        os.execve(
            sys.executable, [sys.executable, *sys.argv], dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        )
    from safetensors.torch import load_file

    from litsft.model.accounting.sizes import num_parameters

    work = Path(tempfile.mkdtemp(prefix="litsft-final-folder-"))
    config = model_config(args.hidden, args.layers)
    print(f"# benchmarks/bench_final_folder_memory.py on {machine_description()}")
    print(f"model: {num_parameters(config) / 1e6:.1f}M parameters, fp32, FULL_SHARD; bf16 weights written")
    context = mp.get_context("fork")
    for ranks in args.ranks:
        growth = {}
        for method in ("gather", "consolidate"):
            results = context.Queue()
            shape = (args.hidden, args.layers)
            workers = [
                context.Process(target=rank_main, args=(rank, ranks, method, shape, str(work), results))
                for rank in range(ranks)
            ]
            for worker in workers:
                worker.start()
            by_rank = dict(results.get(timeout=1200) for _ in workers)
            for worker in workers:
                worker.join()
            seconds = by_rank[0][1]
            by_rank = {rank: grown for rank, (grown, _) in by_rank.items()}
            growth[method] = by_rank[0]
            others = max(by_rank[rank] for rank in range(1, ranks))
            print(
                f"{ranks} ranks, {method:<12} rank 0: +{by_rank[0]:.0f} MiB peak RSS, largest other rank: +{others:.0f} MiB, {seconds:.1f} s"
            )
        written = {}
        for method in growth:
            written[method] = {}
            for path in (work / f"{method}-{ranks}").glob("*.safetensors"):
                written[method] |= load_file(path)
        same = written["gather"].keys() == written["consolidate"].keys() and all(
            torch.equal(tensor, written["consolidate"][name]) for name, tensor in written["gather"].items()
        )
        ratio = growth["consolidate"] / growth["gather"]
        print(f"{ranks} ranks: same tensors written: {same}; consolidate / gather rank-0 growth: {ratio:.2f}")


if __name__ == "__main__":
    main()
