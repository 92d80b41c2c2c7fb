"""Rank 0's peak memory writing the final model folder from a sharded model: litsft's gather vs DCP's
consolidation.

    python benchmarks/bench_final_folder_memory.py [--hidden 768 --layers 12]

Two processes (gloo, forked) hold bench_load_memory.py's model (~113M parameters, fp32) sharded by FSDP2
(FULL_SHARD). Each method runs in a fresh pair of processes and reports rank 0's peak RSS growth while
writing bf16 weights:
  gather        `gather_and_save_model_folder`: one full tensor at a time gathered to rank 0, which streams
                it into the safetensors files (what every run's final/ is written with)
  consolidate   every rank writes its bf16 shards with `HuggingFaceStorageWriter(save_distributed=True,
                enable_consolidation=True)`, and DCP merges them into full tensors on rank 0
Checks that both wrote the same tensors; prints the figures; asserts nothing else. glibc is told to return
freed memory (MALLOC_MMAP_THRESHOLD_), as in bench_load_memory.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from harness import machine_description


def rank_main(rank: int, method: str, shape: tuple[int, int], work: str, results) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from litsft.checkpoint.model_folder import gather_and_save_model_folder
    from litsft.model.network import Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/init-{method}", rank=rank, world_size=2)
    config = model_config(*shape)
    with torch.device("meta"):  # as the engine builds it: no rank ever holds the whole model
        model = Transformer(config)
    mesh = init_device_mesh("cpu", (2,))
    for unit in (*model.blocks, model):  # as litsft.training.parallel shards it under FULL_SHARD
        fully_shard(unit, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)  # the same weights for both methods
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = Path(work) / method
    if method == "gather":
        gather_and_save_model_folder(model, out, config, None)
    else:
        tensors = {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        writer = HuggingFaceStorageWriter(str(out), save_distributed=True, enable_consolidation=True)
        dcp.save(tensors, storage_writer=writer)
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results.put((rank, peak - before))
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
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":  # glibc reads it once, at process start
        os.execve(
            sys.executable, [sys.executable, *sys.argv], dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        )
    from safetensors.torch import load_file

    from litsft.model.sizes import num_parameters

    work = Path(tempfile.mkdtemp(prefix="litsft-final-folder-"))
    config = model_config(args.hidden, args.layers)
    print(f"# benchmarks/bench_final_folder_memory.py on {machine_description()}")
    print(
        f"model: {num_parameters(config) / 1e6:.1f}M parameters, fp32, FULL_SHARD on 2 processes; bf16 weights written"
    )
    context = mp.get_context("fork")
    growth = {}
    for method in ("gather", "consolidate"):
        results = context.Queue()
        workers = [
            context.Process(
                target=rank_main, args=(rank, method, (args.hidden, args.layers), str(work), results)
            )
            for rank in range(2)
        ]
        for worker in workers:
            worker.start()
        by_rank = dict(results.get(timeout=1200) for _ in workers)
        for worker in workers:
            worker.join()
        growth[method] = by_rank[0]
        print(f"{method:<12} rank 0: +{by_rank[0]:.0f} MiB peak RSS, rank 1: +{by_rank[1]:.0f} MiB")
    gathered = {}
    for path in (work / "gather").glob("*.safetensors"):
        gathered |= load_file(path)
    consolidated = {}
    for path in (work / "consolidate").glob("*.safetensors"):
        consolidated |= load_file(path)
    same = gathered.keys() == consolidated.keys() and all(
        torch.equal(gathered[k], consolidated[k]) for k in gathered
    )
    print(
        f"same tensors written: {same}; consolidate / gather rank-0 growth: {growth['consolidate'] / growth['gather']:.2f}"
    )


if __name__ == "__main__":
    main()
