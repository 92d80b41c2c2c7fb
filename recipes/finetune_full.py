"""Full fine-tuning: every weight of a converted checkpoint is trained; the result is a full checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from litsft.cli.launcher import launch
from litsft.cli.validation import check_data
from litsft.data import DataModule
from litsft.huggingface.model_source import local_model_dir, resolve_checkpoint
from litsft.model.config import Config
from litsft.training.args import (
    Accelerator,
    EvalConfig,
    FSDPConfig,
    LogConfig,
    ObjectiveConfig,
    OptimizerConfig,
    ParallelConfig,
    Precision,
    RunConfig,
    TrainConfig,
)
from litsft.training.recipe import Recipe


def setup(
    checkpoint_dir: str,  # not Path, which would drop the ./ that marks a local directory
    out_dir: Path = Path("out/finetune_full"),
    data: DataModule | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Accelerator = "auto",
    precision: Precision | None = None,
    resume: bool | Literal["auto"] | Path = "auto",
    seed: int = 1337,
    fsdp: FSDPConfig = FSDPConfig(),
    parallel: ParallelConfig = ParallelConfig(),
    train: TrainConfig = TrainConfig(),
    eval: EvalConfig = EvalConfig(),
    optimizer: OptimizerConfig = OptimizerConfig(),
    log: LogConfig = LogConfig(),
    objective: ObjectiveConfig = ObjectiveConfig(),
) -> None:
    """Fine-tune all weights of a litsft checkpoint on instruction or conversation data.

    Args:
        checkpoint_dir: The model: a litsft checkpoint directory, a Hugging Face model directory (converted
            once, then reused from a cache) or a hub id such as meta-llama/Llama-3.2-1B (downloaded and
            converted into checkpoints/<org>/<name> on first use).
        out_dir: Where checkpoints, metrics and the final model (out_dir/final) are written.
        data: The data module, e.g. `--data JSON --data.json_path train.json` or `--data Demo`.
        devices: Processes (GPUs) per node.
        num_nodes: Nodes; with HYBRID_SHARD the model is replicated across nodes and sharded within one.
        accelerator: auto (CUDA GPUs when the machine has them, else the CPU), cpu or cuda. On the CPU,
            --devices N runs N processes over gloo.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default bf16-mixed on GPUs that support it, else 32-true.
        resume: "auto" continues from the newest complete checkpoint in out_dir; a path resumes from that
            checkpoint; false starts at step 0, refused when out_dir holds checkpoints (so that none is
            overwritten): pass another --out_dir to start over.
        seed: Seed for data order, dropout and sampling.
        fsdp: Sharding strategy and memory options (used with more than one process).
        parallel: Context parallelism: --parallel.context N splits each sequence over N ranks of a
            node (long sequences; tutorials/long_context.md).
        train: Batch sizes, length of the run and checkpointing.
        eval: Validation settings.
        optimizer: AdamW and the learning-rate schedule.
        log: Metric loggers.
        objective: What training minimizes: cross-entropy on the replies (SFT, the default), or a preference
            objective on pairs of replies (--objective.name dpo, ipo, simpo or orpo; tutorials/preference.md).
    """
    arguments = dict(locals())
    # Before the model is converted or downloaded.
    check_data(data, local_model_dir(checkpoint_dir), objective)
    checkpoint_dir = resolve_checkpoint(checkpoint_dir)
    config = Config.from_checkpoint(checkpoint_dir)
    run = RunConfig.from_arguments(arguments, config, tokenizer_dir=checkpoint_dir)
    launch("finetune_full", lambda: full_finetuning(checkpoint_dir, config), run)


def full_finetuning(checkpoint_dir: Path, config: Config) -> Recipe:
    """Every weight trains, starting from the checkpoint's; the final model is a full checkpoint."""
    # Imported here: litsft.cli.launcher calls this once the run has passed its checks, and torch takes seconds.
    from litsft.checkpoint.model_folder import load_model_weights, save_model_folder_from_ranks
    from litsft.model.network.transformer import Transformer

    return Recipe(
        name="finetune_full",
        build_model=Transformer,
        initialize=lambda model: load_model_weights(model, checkpoint_dir),
        # The model's config: the one the run trained and each step checkpoint records
        # (--train.router_aux_loss_coef applied), so final/ and a step opened as a model agree.
        save_final=lambda model, final_dir: save_model_folder_from_ranks(
            model, final_dir, model.config, checkpoint_dir
        ),
    )
