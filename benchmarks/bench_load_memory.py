"""Per-rank peak memory of loading a checkpoint into a sharded model: FULL_SHARD vs NO_SHARD on 2 ranks.

    python benchmarks/bench_load_memory.py [--hidden 768 --layers 12]

Writes a random litsft checkpoint (default ~110M parameters, fp32), then for each strategy launches 2 processes
(torchrun, gloo) that build the model on the meta device, shard it and fill it from the checkpoint exactly as
the engine does (litsft.training.engine.setup_model), and print each rank's peak RSS growth over the process's RSS
before the model was built. Prints figures and the ratio; asserts nothing. glibc is told to return freed
memory (MALLOC_MMAP_THRESHOLD_), otherwise RSS hides most of the difference (tutorials/cpu_distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def rank_main(checkpoint_dir: Path, strategy: str, result_file: Path) -> None:
    import torch.distributed as dist

    from litsft.checkpoint.model_folder import load_model_weights
    from litsft.model.config import Config
    from litsft.model.network.transformer import Transformer
    from litsft.training.args import FSDPConfig, RunConfig
    from litsft.training.engine import Recipe, setup_model
    from litsft.training.layout import ParallelLayout
    from litsft.training.parallel import build_fabric

    fabric = build_fabric(
        ParallelLayout(2, 1, strategy), "32-true", FSDPConfig(sharding_strategy=strategy), "cpu"
    )
    fabric.launch()
    config = Config.from_checkpoint(checkpoint_dir)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    recipe = Recipe("bench", Transformer, lambda m: load_model_weights(m, checkpoint_dir), lambda m, d: None)
    run = RunConfig(config=config, tokenizer_dir=None, data=None, out_dir=checkpoint_dir, precision="32-true")
    run.fsdp.sharding_strategy = strategy
    setup_model(fabric, recipe, run)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results = [None, None]
    dist.all_gather_object(results, {"rank": fabric.global_rank, "before": before, "peak": peak})
    if fabric.global_rank == 0:
        result_file.write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rank_main", nargs=3)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(Path(args.rank_main[0]), args.rank_main[1], Path(args.rank_main[2]))

    from litsft.checkpoint.model_folder import save_model_folder
    from litsft.model.accounting.sizes import num_parameters
    from litsft.model.config import Config
    from litsft.model.network.transformer import Transformer

    work = Path(tempfile.mkdtemp(prefix="litsft-load-memory-"))
    config = Config.from_name("tiny-llama", vocab_size=32000, hidden_size=args.hidden,
                             intermediate_size=int(args.hidden * 2.75), num_layers=args.layers,
                             num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128)  # fmt: skip
    model = Transformer(config)
    model.init_weights(0)
    save_model_folder(model.state_dict().items(), config, work / "checkpoint")
    size_mib = num_parameters(config) * 4 / 2**20
    del model
    print(
        f"model: {num_parameters(config) / 1e6:.1f}M parameters, {size_mib:.0f} MiB in fp32; 2 ranks on this CPU"
    )
    growth = {}
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        result_file = work / f"{strategy}.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29731", __file__, "--rank_main", str(work / "checkpoint"), strategy, str(result_file)],
                       env=env, check=True, capture_output=True)  # fmt: skip
        ranks = json.loads(result_file.read_text())
        growth[strategy] = max(r["peak"] - r["before"] for r in ranks)
        cells = ", ".join(
            f"rank {r['rank']}: +{r['peak'] - r['before']:.0f} MiB (peak {r['peak']:.0f})" for r in ranks
        )
        print(f"{strategy:<11} {cells}")
    print(f"FULL_SHARD / NO_SHARD peak growth while loading: {growth['FULL_SHARD'] / growth['NO_SHARD']:.2f}")


if __name__ == "__main__":
    main()
