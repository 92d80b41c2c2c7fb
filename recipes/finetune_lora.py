"""LoRA fine-tuning: the base checkpoint stays frozen (and sharded), only low-rank adapters train; checkpoints
and the final result hold the adapters alone, with a reference to the base checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from litsft.cli.launcher import launch
from litsft.cli.validation import check_data
from litsft.data import DataModule
from litsft.errors import LitsftError
from litsft.huggingface.model_source import local_model_dir, resolve_checkpoint
from litsft.model.config import Config
from litsft.model.lora.config import LoRAConfig, Quantization
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
    out_dir: Path = Path("out/finetune_lora"),
    data: DataModule | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: Accelerator = "auto",
    precision: Precision | None = None,
    resume: bool | Literal["auto"] | Path = "auto",
    seed: int = 1337,
    lora: LoRAConfig = LoRAConfig(),
    quantize: Quantization | None = None,
    fsdp: FSDPConfig = FSDPConfig(),
    parallel: ParallelConfig = ParallelConfig(),
    train: TrainConfig = TrainConfig(),
    eval: EvalConfig = EvalConfig(),
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4, warmup_fraction=0.03),
    log: LogConfig = LogConfig(),
    objective: ObjectiveConfig = ObjectiveConfig(),
) -> None:
    """Fine-tune low-rank adapters on top of a frozen litsft checkpoint.

    Args:
        checkpoint_dir: The model: a litsft checkpoint directory, a Hugging Face model directory (converted
            once, then reused from a cache) or a hub id such as meta-llama/Llama-3.2-1B (downloaded and
            converted into checkpoints/<org>/<name> on first use).
        out_dir: Where checkpoints, metrics and the final adapter (out_dir/final) are written.
        data: The data module, e.g. `--data JSON --data.json_path train.json` or `--data Demo`.
        devices: Processes (GPUs) per node.
        num_nodes: Nodes.
        accelerator: auto (CUDA GPUs when the machine has them, else the CPU), cpu or cuda. On the CPU,
            --devices N runs N processes over gloo.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true; default bf16-mixed on GPUs that support it, else 32-true.
        resume: "auto" continues from the newest complete checkpoint in out_dir; a path resumes from that
            checkpoint; false starts at step 0, refused when out_dir holds checkpoints (so that none is
            overwritten): pass another --out_dir to start over.
        seed: Seed for data order, adapter initialization, dropout and sampling.
        lora: Rank, alpha, dropout, variant (a module of litsft/model/lora/variants/: --lora.variant's
            choices) and which projections get adapters.
        quantize: nf4 stores the frozen base weight of every adapted block projection in 4-bit NormalFloat
            (QLoRA): about 0.52 bytes per weight instead of 2 (bf16), sharded by FSDP like any frozen weight.
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
    if objective.reference == "live" and lora.variant == "pissa":
        raise LitsftError(
            "--objective.reference live switches the adapters off to score the reference, but PiSSA moved the "
            "base weights into them; use --objective.reference precomputed (the default)"
        )
    checkpoint_dir = resolve_checkpoint(checkpoint_dir)
    config = Config.from_checkpoint(checkpoint_dir)
    run = RunConfig.from_arguments(arguments, config, tokenizer_dir=checkpoint_dir)
    launch("finetune_lora", lambda: lora_finetuning(checkpoint_dir, lora, quantize, seed, run), run)


def lora_finetuning(
    checkpoint_dir: Path, lora: LoRAConfig, quantize: Quantization | None, seed: int, run: RunConfig
) -> Recipe:
    """Adapters on the frozen base train (over an NF4 base with `quantize`); step checkpoints and the final
    result hold the adapters alone."""
    # Imported here: litsft.cli.launcher calls this once the run has passed its checks, and torch takes seconds.
    from litsft.checkpoint.lora_folder import save_lora_folder
    from litsft.checkpoint.model_folder import load_model_weights
    from litsft.checkpoint.sharded_tensors import copy_local_part, global_rank
    from litsft.model.lora.layers import (
        apply_lora,
        base_weight_name,
        check_expert_targets,
        initial_adapter_value,
        initialize_from_base,
        lora_state_dict,
    )
    from litsft.model.lora.variants import adapter_variant
    from litsft.model.network.transformer import Transformer, parameter_generator
    from litsft.model.precision.quantization import check_nf4_shardable, quantize_base

    variant = adapter_variant(lora.variant)
    base_config = Config.from_checkpoint(checkpoint_dir)
    variant.check(lora, base_config, quantize)  # before any process starts
    check_expert_targets(lora, base_config, quantize)
    if quantize is not None:
        check_nf4_shardable(run.config, run.layout.shard_group_size, lora.target_list)

    def initialize(model: Transformer) -> None:
        load_model_weights(model, checkpoint_dir, stored_name=base_weight_name)
        for name, param in model.named_parameters():
            if param.requires_grad:
                copy_local_part(
                    param.data, initial_adapter_value(name, param.shape, parameter_generator(seed, name))
                )
        initialize_from_base(model)  # what the variant derives from the loaded base (DoRA, PiSSA)

    def save_final(model: Transformer, final_dir: Path) -> None:
        adapters = lora_state_dict(model)  # collective: every rank gathers
        if global_rank() == 0:
            save_lora_folder(adapters, lora, checkpoint_dir, final_dir, base_quantization=quantize)

    return Recipe(
        name="finetune_lora",
        build_model=lambda config: quantize_base(apply_lora(Transformer(config), lora), quantize),
        initialize=initialize,
        save_final=save_final,
        checkpoint_frozen=False,
        frozen_base=checkpoint_dir,
        trainable="lora",
        lr_scale=lambda name: variant.lr_scale(lora, name),
    )
