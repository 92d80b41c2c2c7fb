"""Run settings: every option a training recipe takes besides its model and data, as typed dataclasses.

The recipes' signatures are the CLI (jsonargparse reads these classes, their types and attribute
docstrings for `--help`, `--print_config` and YAML), so this module imports no torch: `litsft plan` and
the parser read it without starting anything heavy. Defaults that depend on the model or the machine are
resolved by `with_defaults`, a pure function; nothing changes a RunConfig in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from litsft.data.step_geometry import StepGeometry
from litsft.errors import LitsftError, check_number
from litsft.model.config import Config
from litsft.model.precision.float8 import Float8Recipe
from litsft.training.layout import ParallelLayout, ShardingStrategy

Precision = Literal["bf16-mixed", "bf16-true", "16-mixed", "32-true"]
Accelerator = Literal["auto", "cpu", "cuda"]
MAX_DEFAULT_SEQ_LENGTH = 2048
"""--train.max_seq_length when none is given: the model's context length, capped here."""


@dataclass
class FSDPConfig:
    """How the model is sharded when more than one process trains it."""

    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    """FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), HYBRID_SHARD (shard in a node, replicate across
    nodes) or NO_SHARD (replicate, like DDP)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less memory, about 1/3 more compute."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (GPU runs only)."""


@dataclass
class ParallelConfig:
    """How the ranks split the work besides sharding the model: a group of its own, apart from --fsdp (which
    says how parameters are sharded), because it splits activations, and the expert axis joins it."""

    context: int = 1
    """Context parallelism: this many ranks (of one node) share each micro-batch, each holding 1/N of every
    row's tokens, and swap attention heads for tokens around attention (all-to-all). Activation memory per
    rank drops about N-fold; N divides --devices and the model's attention heads."""
    expert: int = 1
    """Expert parallelism (MoE models): this many consecutive ranks of a shard group each own 1/N of every MoE
    layer's experts, whole, and send each token to the ranks of its chosen experts and back (all-to-all,
    dropless); the experts' weights are FSDP-sharded over the rest of the shard group. N divides the shard
    group (--devices under HYBRID_SHARD, --devices x --num_nodes otherwise) and the model's experts."""


@dataclass
class TrainConfig:
    """Batch sizes, length of the run and checkpointing."""

    global_batch_size: int = 16
    """Rows (packed sequences or samples) per optimizer step, over all devices and accumulation steps."""
    micro_batch_size: int = 4
    """Rows per device per forward pass; global_batch_size / (micro_batch_size x devices x nodes) is the
    number of gradient-accumulation steps."""
    epochs: int = 1
    """Passes over the training data (used when max_steps is not given)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs; required for streaming data of unknown length)."""
    max_seq_length: int | None = None
    """Tokens per row; defaults to the model's context length, capped at 2048."""
    max_norm: float | None = 1.0
    """Clip the global gradient norm to this value; None disables clipping (the norm is still logged)."""
    save_interval: int | None = None
    """Write a resumable checkpoint every this many optimizer steps."""
    keep_last: int | None = None
    """Keep only the newest this-many step checkpoints (older ones are deleted after a new one is complete)."""
    async_save: bool | None = None
    """Write step checkpoints in the background: a save copies this rank's state to host memory and training
    goes on; the checkpoint is published once every file is on disk. A save still being written is waited
    for before the next one, before the final model is saved and before a stop signal's checkpoint, which is
    written before exit like every last save. On a GPU the copy goes to page-locked buffers kept for the
    run (one copy of the rank's checkpoint in host memory). Default: on for GPU runs where the node's
    available memory holds every process's copy twice over (checked at the first save), off on the CPU,
    where the writing thread takes the cores the step needs (benchmarks/results/async_save_cpu.txt)."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    compile: bool | None = None
    """Compile each transformer block with torch.compile (the first steps are slower). Default: on for GPU
    runs, off on CPU (where compiling costs more time than it saves); false turns it off."""
    router_aux_loss_coef: float | None = None
    """Weight of a mixture of experts' load-balancing loss in the training loss. Default: the model's own
    (its config.json's router_aux_loss_coef: OLMoE 0.01, Qwen3-MoE 0.001, Mixtral-8x7B 0.02); 0 turns it off."""
    router_bias_update_rate: float | None = None
    """A mixture of experts' auxiliary-loss-free balancing (DeepSeek-V3, https://arxiv.org/abs/2412.19437
    section 2.1.2; it used 0.001): each router gets a per-expert bias added to its scores for choosing the
    top k experts only, moved by this much after each optimizer step towards the mean load of the step.
    The bias is saved with the model; transformers' OLMoE, Qwen3-MoE and Mixtral have none, so such a model is
    not exported to Hugging Face. finetune_full and pretrain. Default: the model's own (0, off)."""
    float8: Float8Recipe | None = None
    """Run the blocks' large projections in float8 on GPUs with float8 tensor cores (compute capability 8.9+:
    L4, RTX 4090, H100, B200), through torchao: tensorwise (one scale per tensor; with several GPUs the weights
    are all-gathered in float8) or rowwise (one scale per row: more accurate, slower). finetune_full and
    pretrain, bf16 precision only. Default: off."""
    deterministic: bool = False
    """Bit-identical reruns: torch.use_deterministic_algorithms(True), fixed cuBLAS workspace, no cuDNN
    autotuning. Free on CPU (already deterministic for a fixed --seed, devices and batch sizes); on GPUs
    some kernels (e.g. the embedding backward) are slower, and an op without a deterministic version
    stops the run with an error."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "epochs", "max_steps", "max_seq_length",
                     "save_interval", "keep_last", "log_interval"):  # fmt: skip
            check_number(f"--train.{name}", getattr(self, name), at_least=1)
        check_number("--train.max_norm", self.max_norm, above=0, fix="pass null to disable clipping")
        check_number("--train.router_aux_loss_coef", self.router_aux_loss_coef, at_least=0)
        check_number("--train.router_bias_update_rate", self.router_bias_update_rate, at_least=0)


@dataclass
class EvalConfig:
    """Validation during and after training."""

    interval: int | None = None
    """Validate every this many optimizer steps (and always at the end)."""
    max_batches: int | None = 20
    """Micro-batches per validation pass (None: the whole validation set)."""
    max_new_tokens: int = 40
    """Length of the sample generated at each validation from the first validation prompt (SFT data), printed
    and written to out_dir/samples.txt; 0 generates none."""
    tasks: str | None = None
    """lm-evaluation-harness tasks scored at every validation on the model being trained, comma-separated
    (as `litsft evaluate --tasks`; needs `pip install 'litsft[eval]'`): every process scores a share of the
    requests; the metrics go to out_dir/tasks.csv, TensorBoard/W&B and loss.png."""
    num_fewshot: int | None = None
    """Examples in each task prompt. Default: each task's own."""
    limit: int | float | None = None
    """Score only this many documents of each task (a fraction of them when below 1): tasks run at every
    validation, so keep them small."""
    batch_size: int = 8
    """Sequences per forward pass while scoring the tasks."""
    apply_chat_template: bool = False
    """Render task prompts through the chat template."""
    fewshot_as_multiturn: bool = True
    """With the chat template, each few-shot example a turn of its own."""
    include_path: str | None = None
    """A folder of your own task YAML files."""
    confirm_run_unsafe_code: bool = False
    """Allow tasks that execute the code the model writes (also needs HF_ALLOW_CODE_EVAL=1)."""

    def __post_init__(self) -> None:
        check_number("--eval.interval", self.interval, at_least=1)
        check_number("--eval.batch_size", self.batch_size, at_least=1)
        check_number("--eval.max_batches", self.max_batches, at_least=1, fix="pass null for the whole set")
        check_number("--eval.max_new_tokens", self.max_new_tokens, at_least=0, fix="0 generates no sample")


@dataclass
class LogConfig:
    """Where metrics go."""

    loggers: list[Literal["csv", "tensorboard", "wandb"]] = field(default_factory=lambda: ["csv"])
    """Where metrics are written besides the progress bar: csv (out_dir/metrics.csv), tensorboard, wandb."""
    timings: bool = False
    """Print the wall time of each phase of the run at its end (start-up, checks, imports, data, model, training,
    final validation and save), with the process's peak resident memory as each phase ended."""
    profile_steps: str | int | None = None
    """Optimizer steps to profile, e.g. 3, 3,7 or 3:5 (steps 3, 4 and 5; in YAML quote it, "3:5", which YAML
    would read as the number 185): each rank writes a torch.profiler Chrome trace of each such step into
    out_dir/profile/ (open it in https://ui.perfetto.dev), and on CUDA a memory snapshot of it
    (https://pytorch.org/memory_viz). Profiled steps run slower: their throughput is not the run's."""

    def __post_init__(self) -> None:
        if self.profile_steps is not None:
            # `3` on the command line or in YAML arrives as a number.
            self.profile_steps = str(self.profile_steps)
            profiled_steps(self.profile_steps)


def profiled_steps(spec: str | None) -> frozenset[int]:
    """The steps `--log.profile_steps` names: step numbers separated by commas, each one a step or a range
    start:end with both ends included."""
    steps: set[int] = set()
    if spec is None:
        return frozenset()
    for part in spec.replace(" ", "").split(","):
        start, colon, end = part.partition(":")
        if not (start.isdigit() and (end.isdigit() if colon else True)):
            raise LitsftError(
                f"--log.profile_steps={spec!r} is not a list of steps; write e.g. 3, 3,7 or 3:5 (steps 3 to 5)"
            )
        first, last = int(start), int(end) if colon else int(start)
        if first < 1 or last < first:
            raise LitsftError(
                f"--log.profile_steps={spec!r}: {part} names no step; steps count from 1 and a range "
                "start:end needs start <= end"
            )
        steps.update(range(first, last + 1))
    return frozenset(steps)


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 2e-5
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of a cosine or linear decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices and embeddings only (not to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's decay rates of the gradient's running mean and of its running square, e.g. [0.9, 0.95]."""
    eps: float = 1e-8
    """Added to the root of AdamW's running square before dividing by it, for numerical stability."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warmup."""
    warmup_steps: int | None = None
    """Linear warmup length W in optimizer steps: step k (from 1) runs at lr * k / W, so the first step already
    trains at lr/W and step W at lr. transformers' schedules (get_cosine_schedule_with_warmup and the others)
    start at 0 instead: their step k runs at lr * (k - 1) / W, one step behind."""
    warmup_fraction: float = 0.0
    """Warmup as a fraction of all optimizer steps; used when warmup_steps is not given."""

    def __post_init__(self) -> None:
        check_number(
            "--optimizer.lr", self.lr, above=0, fix="use e.g. 2e-5 (full fine-tuning) or 2e-4 (LoRA)"
        )
        check_number("--optimizer.min_lr", self.min_lr, at_least=0, fix="use 0 to decay to zero")
        if self.min_lr > self.lr:
            raise LitsftError(
                f"--optimizer.min_lr={self.min_lr} is above --optimizer.lr={self.lr}, so the schedule would rise "
                "instead of decay; use a min_lr of at most lr (e.g. lr / 10, or 0)"
            )
        check_number(
            "--optimizer.weight_decay", self.weight_decay, at_least=0, fix="use 0 for none, e.g. 0.1"
        )
        for beta in self.betas:
            check_number("--optimizer.betas", beta, at_least=0, below=1, fix="use e.g. [0.9, 0.95]")
        check_number("--optimizer.eps", self.eps, above=0, fix="use e.g. 1e-8")
        check_number("--optimizer.warmup_steps", self.warmup_steps, at_least=0, fix="use 0 for no warmup")
        check_number(
            "--optimizer.warmup_fraction", self.warmup_fraction, at_least=0, at_most=1,
            fix="it is the share of all steps spent warming up, e.g. 0.03",
        )  # fmt: skip


ObjectiveName = Literal["cross_entropy", "dpo", "ipo", "simpo", "orpo"]
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")


@dataclass
class ObjectiveConfig:
    """What training minimizes (litsft.training.objectives): next-token cross-entropy on the data's replies
    (SFT), or a preference objective on pairs of replies to one prompt (records with 'chosen' and 'rejected',
    tutorials/preference.md)."""

    name: ObjectiveName = "cross_entropy"
    """cross_entropy (SFT); dpo (sigmoid DPO against the starting model, the default preference objective),
    ipo, simpo or orpo (both without a reference model)."""
    beta: float | None = None
    """The preference objective's temperature (DPO, IPO, SimPO) or ORPO's odds-ratio weight lambda; None: 0.1,
    or 2.0 for SimPO (its paper's range is 2 to 2.5)."""
    label_smoothing: float = 0.0
    """DPO and SimPO: the probability that a pair's preference is flipped (cDPO), in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target margin gamma between the chosen and rejected replies' scaled mean log-probabilities."""
    reference: Literal["precomputed", "live"] = "precomputed"
    """Where DPO's and IPO's reference log-probabilities come from: precomputed, one no-grad pass over the data
    before the first step (kept in out_dir/reference_logps); live (finetune_lora), the base model with the
    adapters switched off, scored in a second no-grad forward pass of every micro-batch (no pass before
    training, no second copy of the model)."""

    def __post_init__(self) -> None:
        check_number("--objective.beta", self.beta, above=0, fix="use e.g. 0.1 (DPO) or 2.0 (SimPO)")
        check_number("--objective.label_smoothing", self.label_smoothing, at_least=0, below=0.5,
                     fix="use 0 (none) to 0.3")  # fmt: skip
        if self.label_smoothing and self.name not in ("dpo", "simpo"):
            raise LitsftError(
                f"--objective.label_smoothing is for dpo and simpo, not {self.name}; drop the flag"
            )

    @property
    def pairs(self) -> bool:
        """Whether it trains on preference pairs."""
        return self.name in PREFERENCE_OBJECTIVES

    def options(self) -> dict[str, Any]:
        """The objective's constructor options (litsft.training.objectives.objective_named)."""
        if not self.pairs:
            return {}
        return {
            "beta": self.beta,
            "label_smoothing": self.label_smoothing,
            "simpo_gamma": self.simpo_gamma,
            "reference": self.reference,
        }


@dataclass
class RunConfig:
    """Everything the engine needs besides the recipe; the recipes' CLI arguments, gathered."""

    config: Config
    tokenizer_dir: Path | None
    data: Any
    out_dir: Path
    devices: int = 1
    num_nodes: int = 1
    accelerator: Accelerator = "auto"
    precision: Precision | None = None
    resume: bool | Literal["auto"] | Path = "auto"
    seed: int = 1337
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    cli_arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(
        cls, arguments: dict[str, Any], config: Config, tokenizer_dir: Path | None
    ) -> RunConfig:
        """A recipe's CLI arguments (its `locals()`) as a RunConfig; the ones RunConfig does not know stay
        recorded in cli_arguments only."""
        known = {f.name for f in dataclasses.fields(cls)} - {"config", "tokenizer_dir", "cli_arguments"}
        chosen = {name: value for name, value in arguments.items() if name in known}
        return cls(config=config, tokenizer_dir=tokenizer_dir, cli_arguments=arguments, **chosen)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def layout(self) -> ParallelLayout:
        """How this run's ranks divide the work (refused in one line if they cannot)."""
        return ParallelLayout.of(
            self.devices,
            self.num_nodes,
            self.fsdp.sharding_strategy,
            self.parallel.context,
            self.parallel.expert,
        )


CONFIG_OPTIONS = {
    "router_aux_loss_coef": "--train.router_aux_loss_coef",
    "router_bias_update_rate": "--train.router_bias_update_rate",
}
"""The model config's fields that a command-line option sets (`run_model_config`), by the option."""


def run_model_config(run: RunConfig) -> Config:
    """The model `run` trains: its checkpoint's config with what the command line changes in it (each of
    CONFIG_OPTIONS, each a mixture of experts' and refused for a dense model). `with_defaults` puts it into the
    run, which builds the model and records it in each checkpoint, and a resume compares the checkpoint's record
    with it: one function, so that a run resumed with the command that started it is always the same model."""
    config = run.config
    for field_name, option in CONFIG_OPTIONS.items():
        value = getattr(run.train, field_name)
        if value is None:
            continue
        if not config.num_experts:
            raise LitsftError(
                f"{option}: {config.name} is not a mixture of experts, it has no router; drop the flag"
            )
        config = dataclasses.replace(config, **{field_name: value})
    return config


def with_defaults(run: RunConfig, default_precision: Precision) -> RunConfig:
    """A copy of `run` with the unset precision and sequence length filled in: `default_precision` (what
    the machine supports best) and the model's context length capped at MAX_DEFAULT_SEQ_LENGTH; and its model
    config as the command line changes it (`run_model_config`)."""
    max_seq_length = run.train.max_seq_length or min(
        run.config.max_position_embeddings, MAX_DEFAULT_SEQ_LENGTH
    )
    return dataclasses.replace(
        run,
        config=run_model_config(run),
        precision=run.precision or default_precision,
        train=dataclasses.replace(
            run.train,
            max_seq_length=max_seq_length,
            compile=on_cuda_by_default(run.train.compile, str(run.accelerator)),
        ),
    )


def on_cuda_by_default(setting: bool | None, device_type: str) -> bool:
    """An on/off option (--train.compile, --train.async_save): as given, else on for CUDA runs only."""
    return setting if setting is not None else device_type == "cuda"


def step_geometry(train: TrainConfig, world_size: int) -> StepGeometry:
    """How this run's optimizer steps are cut across `world_size` processes; refuses sizes that do not divide."""
    return StepGeometry.of(train.global_batch_size, train.micro_batch_size, world_size)


def describe(value: Any) -> Any:
    """A JSON-friendly view of CLI arguments (dataclasses, paths, data modules) for logs and checkpoints."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"class": type(value).__name__, **fields}
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
