"""Pretraining from scratch: a named config with freshly initialized weights, trained on streamed text."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from litsft.checkpoint.checkpoint_dirs import is_step_checkpoint
from litsft.cli.launcher import launch
from litsft.cli.validation import check_data
from litsft.data import DataModule
from litsft.errors import LitsftError
from litsft.huggingface.model_source import resolve_checkpoint
from litsft.model.config import CONFIG_FILENAME, Config
from litsft.training.args import (
    Accelerator,
    EvalConfig,
    FSDPConfig,
    LogConfig,
    OptimizerConfig,
    ParallelConfig,
    Precision,
    RunConfig,
    TrainConfig,
)
from litsft.training.recipe import Recipe


def setup(
    model_name: str,
    tokenizer_dir: Path | None = None,
    out_dir: Path = Path("out/pretrain"),
    data: DataModule | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Accelerator = "auto",
    precision: Precision | None = None,
    resume: bool | Literal["auto"] | Path = "auto",
    seed: int = 1337,
    fsdp: FSDPConfig = FSDPConfig(),
    parallel: ParallelConfig = ParallelConfig(),
    train: TrainConfig = TrainConfig(global_batch_size=64, micro_batch_size=8),
    eval: EvalConfig = EvalConfig(),
    optimizer: OptimizerConfig = OptimizerConfig(
        lr=3e-4, min_lr=3e-5, weight_decay=0.1, warmup_fraction=0.02
    ),
    log: LogConfig = LogConfig(),
) -> None:
    """Pretrain a model from scratch.

    Args:
        model_name: A named config (`litsft list_models`) or a directory holding a litsft_config.json.
        tokenizer_dir: A directory with tokenizer.json (and tokenizer_config.json); its vocabulary must fit
            the model's vocab_size. Defaults to model_name when that is a checkpoint directory.
        out_dir: Where checkpoints, metrics and the final model (out_dir/final) are written.
        data: The data module, e.g. `--data TextFiles --data.train_data_path corpus/` or `--data LitData --data.path ...`.
        devices: Processes (GPUs) per node.
        num_nodes: Nodes; with HYBRID_SHARD the model is replicated across nodes and sharded within one.
        accelerator: auto (CUDA GPUs when the machine has them, else the CPU), cpu or cuda. On the CPU,
            --devices N runs N processes over gloo.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default bf16-mixed on GPUs that support it, else 32-true.
        resume: "auto" continues from the newest complete checkpoint in out_dir; a path resumes from that
            checkpoint; false starts at step 0, refused when out_dir holds checkpoints (so that none is
            overwritten): pass another --out_dir to start over.
        seed: Seed for initialization, data order and dropout.
        fsdp: Sharding strategy and memory options (used with more than one process).
        parallel: Context parallelism: --parallel.context N splits each sequence over N ranks of a
            node (long sequences; tutorials/long_context.md).
        train: Batch sizes, length of the run and checkpointing.
        eval: Validation settings.
        optimizer: AdamW and the learning-rate schedule.
        log: Metric loggers.
    """
    arguments = dict(locals())
    if is_step_checkpoint(Path(model_name)):  # its model's config and tokenizer
        model_name = str(resolve_checkpoint(model_name))
    is_dir = (Path(model_name) / CONFIG_FILENAME).is_file()
    config = Config.from_checkpoint(model_name) if is_dir else Config.from_name(model_name)
    if tokenizer_dir is None:
        if not is_dir:
            raise LitsftError(
                f"pretraining {model_name} needs a tokenizer: pass --tokenizer_dir <dir with tokenizer.json>"
            )
        tokenizer_dir = Path(model_name)
    check_data(data, tokenizer_dir)
    run = RunConfig.from_arguments(arguments, config, tokenizer_dir=tokenizer_dir)
    launch("pretrain", lambda: pretraining(config, tokenizer_dir, seed), run)


def pretraining(config: Config, tokenizer_dir: Path, seed: int) -> Recipe:
    """Fresh weights, every one trained; the final model is a full checkpoint with the tokenizer's files."""
    # Imported here: litsft.cli.launcher calls this once the run has passed its checks, and torch takes seconds.
    from litsft.checkpoint.model_folder import save_model_folder_from_ranks
    from litsft.checkpoint.sharded_tensors import copy_local_part
    from litsft.model.network.transformer import Transformer, parameter_generator

    def initialize(model: Transformer) -> None:
        # Drawn per parameter from its own generator: the same weights on 1 GPU or 64.
        for name, param in model.named_parameters():
            copy_local_part(
                param.data, model.initial_value(name, param.shape, parameter_generator(seed, name))
            )

    return Recipe(
        name="pretrain",
        build_model=Transformer,
        initialize=initialize,
        # The model's config: the one the run trained and each step checkpoint records
        # (--train.router_aux_loss_coef applied), so final/ and a step opened as a model agree.
        save_final=lambda model, final_dir: save_model_folder_from_ranks(
            model, final_dir, model.config, tokenizer_dir
        ),
    )
