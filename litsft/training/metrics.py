"""Training metrics: throughput and MFU, memory, token-weighted loss, and the logger that writes them.

The engine loop says what is measured; this module says how. Nothing here synchronizes the host with
the device in the hot loop: step values are accumulated as device tensors and read (`.item()`, a clock,
an all-reduce) only when the engine asks for them at a log step.

Use in the engine loop (all ranks call it; only global rank 0 writes):

    metrics = MetricsLogger(out_dir, is_global_zero=fabric.is_global_zero, total_steps=total_steps)
    metrics.set_model(config, world_size=..., device=..., precision=...)
    for ...:
        loss, grad_norm, target_tokens, input_tokens = train_step(...)   # device tensors, global
        metrics.step_done(step, ..., micro_batches=micro_batches, log=step % log_interval == 0)
        with metrics.paused():                                            # not training time
            validate(...)                                                 # -> metrics.validation_done(...)
    metrics.close()                                                       # writes loss.png
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import Metric

from litsft.model.accounting.flops import TrainingFlops, device_peak_flops
from litsft.model.config import Config
from litsft.model.network.batch import attended_lengths
from litsft.runtime.timings import peak_rss_bytes
from litsft.training.loggers import CSVWriter, LoggerName, MetricWriter, check_loggers, metric_loggers

PREFERENCE_METRICS = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")
"""What preference objectives log beside their loss (litsft.training.objectives.preference), as means over
pairs: blank for cross-entropy runs."""
# One CSV for the whole run: a row per log step (train columns filled) and a row per validation
# (val columns filled); blank where a value does not apply or is unknown (MFU on an unknown device).
CSV_COLUMNS: tuple[str, ...] = (
    "step",
    "epoch",
    "loss",
    "learning_rate",
    "grad_norm",
    "router_aux_loss",
    "expert_load",
    "expert_load_layer",
    "tokens_per_second",
    "tokens_per_second_per_device",
    "loss_tokens_per_second",
    "mfu",
    "peak_gpu_memory_allocated_mib",
    "peak_rss_mib",
    *PREFERENCE_METRICS,
    "val_loss",
    "val_perplexity",
    "val_tokens",
    *(f"val_{name}" for name in PREFERENCE_METRICS),
)
TRAIN_METRICS = frozenset(name for name in CSV_COLUMNS if not name.startswith("val_")) - {"step"}
PLOT_FILENAME = "loss.png"
SAMPLES_FILENAME = "samples.txt"
# A mixture of experts' balance, a row per MoE layer per log step, beside metrics.csv: a column per layer
# there would be 48 more columns for a 48-layer model, most of them blank for a dense one.
EXPERT_LOAD_FILENAME = "expert_load.csv"
# The scores of --eval.tasks, a row per score per validation: tasks and their metrics are the user's choice.
TASKS_FILENAME = "tasks.csv"
TASK_COLUMNS: tuple[str, ...] = ("step", "task", "metric", "value")
EXPERT_LOAD_COLUMNS: tuple[str, ...] = (
    "step",
    "layer",
    "load",
    "busiest_share",
    "busiest_expert",
    "idle_experts",
)


def expert_balance(expert_tokens: Tensor) -> Tensor:
    """Each MoE layer's balance from the assignments each of its experts received (L, E), as (L, 4) columns
    EXPERT_LOAD_COLUMNS[2:]: the load (the busiest expert's assignments over the mean: 1 when even, E when one
    expert takes them all), the busiest expert's share of the layer's assignments (load / E), that expert,
    and how many experts received none. On the device."""
    busiest, expert = expert_tokens.max(dim=-1)  # (L,) each
    share = busiest / expert_tokens.sum(dim=-1).clamp(min=1e-9)
    idle = (expert_tokens == 0).sum(dim=-1)
    return torch.stack([share * expert_tokens.shape[-1], share, expert.float(), idle.float()], dim=-1)


def loss_figure(
    history: list[dict[str, float | None]], title: str, task_history: Sequence[dict[str, float]] = ()
) -> Any:
    """The training and validation losses of the logged rows against the optimizer step (whole steps on
    the axis), as a matplotlib Figure, with a second panel of the `--eval.tasks` scores when there are
    some (`task_history`: a dict of step and `task/metric` scores per validation); None when no row has a
    loss."""
    # Figure without pyplot: renders with Agg and leaves the global backend and figures alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r["loss"]) for r in history if r["loss"] is not None]
    val = [(r["step"], r["val_loss"]) for r in history if r["val_loss"] is not None]
    if not train and not val:
        return None
    figure = Figure(figsize=(8, 8 if task_history else 5), layout="constrained")
    axes, *task_axes = figure.subplots(2 if task_history else 1, squeeze=False)[:, 0]
    if task_axes:
        _plot_task_scores(task_axes[0], task_history)
    if train:
        axes.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        axes.plot(*zip(*val), label="validation loss", marker="o", linewidth=1.5)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (nats per token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def _plot_task_scores(axes: Any, task_history: Sequence[dict[str, float]]) -> None:
    from matplotlib.ticker import MaxNLocator

    names = sorted({name for row in task_history for name in row} - {"step"})
    for name in names:
        points = [(row["step"], row[name]) for row in task_history if name in row]
        axes.plot(*zip(*points), label=name, marker="o", linewidth=1.5)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("task score")
    axes.set_title("--eval.tasks")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")


# ---- throughput and memory ------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _to_floats(values: Sequence[Tensor | float | int]) -> list[float]:
    """Read a few scalars with one device-to-host copy instead of one per tensor."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return [float(v) for v in values]  # type: ignore[arg-type]
    device = tensors[0].device  # a CPU scalar among CUDA ones moves there without a sync
    read = iter(torch.stack([t.detach().float().reshape(()).to(device) for t in tensors]).tolist())
    return [next(read) if isinstance(v, Tensor) else float(v) for v in values]


class Throughput:
    """Tokens per second and MFU over the optimizer steps between two log steps.

    The clock is read, and the device synchronized, only in `compute()` and around `paused()` sections,
    so the hot loop stays asynchronous. Tokens are the non-padding input tokens: padding is computed
    but not counted, so padding waste shows up as lower MFU, not as fake throughput. MFU is over the FLOPs
    the steps executed (`TrainingFlops.executed`: attention within each document, the head on the loss
    tokens), not over a fixed count per token that credits attention over whole rows.
    """

    def __init__(self, world_size: int, device: torch.device, peak_flops: float | None) -> None:
        """
        Args:
            world_size: Number of devices that the token and FLOP counts are summed over.
            device: The local training device (synchronized before the clock is read).
            peak_flops: Peak FLOP/s of one device (`device_peak_flops`); None reports no MFU.
        """
        self.world_size = world_size
        self.device = device
        self.peak_flops = peak_flops
        self._reset_window()

    def _reset_window(self) -> None:
        self._input_tokens: Tensor | int = 0
        self._loss_tokens: Tensor | int = 0
        self._executed_flops: Tensor | float = 0.0
        self._steps = 0
        self._elapsed = 0.0
        self._started: float | None = time.perf_counter()

    def update(
        self, input_tokens: Tensor | int, loss_tokens: Tensor | int, executed_flops: Tensor | float
    ) -> None:
        """Count one optimizer step. The token counts are global (summed over ranks and micro-batches), as
        device tensors or ints: input tokens that are not padding, and labels that are not -100.
        `executed_flops` are this rank's (a host tensor or a number), summed over ranks at `compute()`."""
        self._input_tokens = self._input_tokens + input_tokens
        self._loss_tokens = self._loss_tokens + loss_tokens
        self._executed_flops = self._executed_flops + executed_flops
        self._steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave a section (validation, checkpointing) out of the measured time."""
        _synchronize(self.device)
        if self._started is not None:
            self._elapsed += time.perf_counter() - self._started
        self._started = None
        try:
            yield
        finally:
            _synchronize(self.device)
            self._started = time.perf_counter()

    def compute(self) -> dict[str, float | None]:
        """Rates over the steps since the last call (which starts a new window); {} if there were none."""
        _synchronize(self.device)
        elapsed = self._elapsed + (time.perf_counter() - self._started if self._started is not None else 0.0)
        steps = self._steps
        executed_flops = torch.as_tensor(self._executed_flops, dtype=torch.float64).to(self.device)
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(executed_flops)  # every rank logs at the same steps
        input_tokens, loss_tokens, flops = _to_floats([self._input_tokens, self._loss_tokens, executed_flops])
        self._reset_window()
        if steps == 0 or elapsed <= 0:
            return {}
        tokens_per_second = input_tokens / elapsed
        return {
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_device": tokens_per_second / self.world_size,
            "loss_tokens_per_second": loss_tokens / elapsed,
            "mfu": flops / elapsed / (self.peak_flops * self.world_size) if self.peak_flops else None,
        }


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory of this process since it started, in MiB (2**20 bytes).

    `peak_gpu_memory_allocated_mib` is `torch.cuda.max_memory_allocated` (tensors only; the caching
    allocator reserves somewhat more), present on CUDA only. `peak_rss_mib` is the process's peak
    resident host memory (`litsft.runtime.timings.peak_rss_bytes`), which on CPU is where the model lives.
    """
    memory = {"peak_rss_mib": peak_rss_bytes() / 2**20}
    if device.type == "cuda":
        memory["peak_gpu_memory_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return memory


# ---- loss aggregation ------------------------------------------------------------------------------
class TokenWeightedMean(Metric):
    """Mean loss per token: sum of per-token losses over sum of tokens, across updates and ranks.

    `update` only adds device tensors; `compute` all-reduces the two sums over the default process
    group when one exists (torchmetrics' sync), so every rank gets the same global value. Averaging
    per-rank means instead would over-weight ranks whose batches have fewer label tokens.
    Move it to the training device first (`.to(device)`): NCCL reduces CUDA tensors only.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    loss_sum: Tensor
    tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor | float, tokens: Tensor | int) -> None:
        """Add a batch: the sum of its per-token losses and the number of tokens in that sum."""
        self.loss_sum += torch.as_tensor(loss_sum, device=self.loss_sum.device).detach().float()
        self.tokens += torch.as_tensor(tokens, device=self.tokens.device).long()

    def compute(self) -> Tensor:
        """The global mean; NaN when no tokens were counted."""
        return self.loss_sum / self.tokens


def perplexity(loss: float) -> float:
    """exp(mean loss per token); inf where the exponential overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# ---- loggers ---------------------------------------------------------------------------------------
class MetricsLogger:
    """Writes metrics on the global-zero rank through the back-ends of `litsft.training.loggers` (metrics.csv,
    optional TensorBoard and W&B), a tqdm progress bar with ETA, samples.txt, a mixture of experts'
    expert_load.csv, and loss.png at `close()`.
    Other ranks write and show nothing."""

    def __init__(
        self,
        out_dir: Path | str,
        *,
        is_global_zero: bool,
        loggers: Sequence[LoggerName] = ("csv",),
        total_steps: int | None = None,
        start_step: int = 0,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            out_dir: Run directory; files go directly in it, TensorBoard events under tensorboard/.
            is_global_zero: Whether this process is rank 0 of the whole job.
            loggers: Any of "csv", "tensorboard", "wandb".
            total_steps: Optimizer steps in the run, for the progress bar's ETA; None shows no ETA.
            start_step: The step a resumed run starts after: metrics.csv keeps its rows up to this step
                and appends; 0 starts a fresh metrics.csv.
            run_config: Hyperparameters recorded with the run (W&B config, TensorBoard text).
        """
        check_loggers(loggers)
        self.out_dir = Path(out_dir)
        self.is_global_zero = is_global_zero
        self.loggers = tuple(dict.fromkeys(loggers))
        self.history: list[dict[str, float | None]] = []
        """Every row logged (and, on resume, kept from metrics.csv): the data behind loss.png."""
        self._closed = False
        self._close_lock = threading.Lock()
        self._writers: list[MetricWriter] = []
        self._start_step = start_step
        self._expert_load_writer: CSVWriter | None = None
        """expert_load.csv, opened at the first log step of a mixture of experts."""
        self._tasks_writer: CSVWriter | None = None
        """tasks.csv, opened at the first validation with --eval.tasks."""
        self.task_history: list[dict[str, float]] = []
        """The --eval.tasks scores of each validation (a resumed run's earlier ones too): the second panel of
        loss.png."""
        self._last_task_results: tuple[int, dict[str, Any]] | None = None
        self._bar: Any = None
        self._bar_in_terminal = False
        self._throughput: Throughput | None = None
        self._training_flops: TrainingFlops | None = None
        self._forward_flops: TrainingFlops | None = None
        self._extra_forward_passes = 0
        self._context = 1
        self._device = torch.device("cpu")
        # The engine's step loss and token counts are already global: no second all-reduce.
        self._train_loss = TokenWeightedMean(sync_on_compute=False)
        if not is_global_zero:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._writers = metric_loggers(self.loggers, self.out_dir, CSV_COLUMNS, start_step, run_config or {})
        for writer in self._writers:
            if isinstance(writer, CSVWriter):
                kept = writer.kept_rows
                self.history += [{k: float(r[k]) if r.get(k) else None for k in CSV_COLUMNS} for r in kept]
        from tqdm import tqdm

        # Outside a terminal (a batch job's log file) redraw rarely: each redraw is a line there.
        self._bar_in_terminal = sys.stderr.isatty()
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0 if self._bar_in_terminal else 30.0,
        )

    def _write(self, row: dict[str, float | None], prefix: str) -> None:
        self.history.append(row)
        for writer in self._writers:
            writer.log(row, prefix)

    def set_model(
        self,
        config: Config,
        *,
        world_size: int,
        device: torch.device,
        precision: str,
        trainable: Literal["all", "lora"] = "all",
        adapter_parameters: int = 0,
        peak_flops: float | None = None,
        context: int = 1,
        extra_forward_passes: int = 0,
    ) -> None:
        """Enable throughput, MFU and GPU-memory columns for training `config` (see `TrainingFlops`).

        Args:
            config: The model's shape.
            world_size: Number of devices in the job.
            device: This rank's device.
            precision: Fabric's precision setting, e.g. "bf16-mixed", to look up the peak FLOP/s.
            trainable: "all" for full fine-tuning and pretraining, "lora" for frozen base weights.
            adapter_parameters: With "lora", the trained adapter parameters.
            peak_flops: Peak FLOP/s of one device, overriding the table (see `device_peak_flops`).
            context: Ranks that share each micro-batch (context parallelism): each executes 1/context of
                the FLOPs of the micro-batches it is handed, so that MFU counts each token's work once.
            extra_forward_passes: No-grad forward passes each micro-batch also gets (the objective's
                `extra_forward_passes`: a live reference), whose FLOPs count as executed too.
        """
        self._context = context
        self._device = device
        self._train_loss.to(device)
        self._training_flops = TrainingFlops.of(config, trainable, adapter_parameters)
        self._forward_flops = TrainingFlops.of(config, "none") if extra_forward_passes else None
        self._extra_forward_passes = extra_forward_passes
        self._throughput = Throughput(world_size, device, device_peak_flops(device, precision, peak_flops))

    def step_done(
        self,
        step: int,
        *,
        epoch: int,
        loss: Tensor | float,
        learning_rate: float,
        grad_norm: Tensor | float | None,
        target_tokens: Tensor | int,
        input_tokens: Tensor | int,
        micro_batches: Sequence[dict[str, Tensor]],
        log: bool,
        routing: dict[str, Tensor] | None = None,
        objective_means: dict[str, Tensor] | None = None,
    ) -> None:
        """Count one optimizer step; with `log`, read and write the metrics of the steps since the last log.

        Only `log` steps synchronize with the device. The logged loss is the token-weighted mean over the
        steps since the last log; the other values are this step's.

        Args:
            step: Optimizer steps completed.
            epoch: The epoch this step's data came from.
            loss: This step's global mean loss per target token.
            learning_rate: This step's learning rate.
            grad_norm: This step's global gradient norm (before clipping).
            target_tokens: Global count of labels that are not -100 in this step.
            input_tokens: Global count of input tokens that are not padding in this step.
            micro_batches: This rank's micro-batches of the step, as the loader made them (on the host):
                their documents and loss tokens give the FLOPs the step executed, for MFU.
            log: Whether to write a row now.
            routing: A mixture of experts' router_aux_loss and expert_tokens (L, E) of this step
                (`RoutingTally`), on log steps: metrics.csv gets the load of its least balanced layer and that
                layer (`expert_balance`), expert_load.csv every layer's balance.
            objective_means: The objective's logged statistics of this step (`Objective.logged`: a
                preference objective's rewards), means over its units.
        """
        self.update_progress(step)
        loss = torch.as_tensor(loss)
        if self._train_loss.device != loss.device:
            self._train_loss.to(loss.device)
        self._train_loss.update(loss * target_tokens, target_tokens)
        if self._throughput is not None:
            self._throughput.update(input_tokens, target_tokens, self._executed_flops_of(micro_batches))
        if not log:
            return
        routing = dict(routing or {})
        expert_tokens = routing.pop("expert_tokens", None)
        if expert_tokens is not None:
            balance = expert_balance(expert_tokens)  # (L, 4)
            worst = balance[:, 0].argmax()
            routing.update(expert_load=balance[worst, 0], expert_load_layer=worst)
            self._log_expert_balance(step, balance)
        metrics: dict[str, float | Tensor | None] = {
            "epoch": epoch,
            "loss": self._train_loss.compute(),
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            **routing,
            **(objective_means or {}),
        }
        self._train_loss.reset()
        if self._throughput is not None:
            metrics.update(self._throughput.compute())
        metrics.update(peak_memory(self._device))
        self.log_step(step, metrics)

    def _log_expert_balance(self, step: int, balance: Tensor) -> None:
        """A row per MoE layer in expert_load.csv (`expert_balance`'s columns), on the global-zero rank."""
        if not self.is_global_zero:
            return
        if self._expert_load_writer is None:
            self._expert_load_writer = CSVWriter(
                self.out_dir, EXPERT_LOAD_COLUMNS, self._start_step, {}, filename=EXPERT_LOAD_FILENAME
            )
        for layer, (load, share, expert, idle) in enumerate(balance.tolist()):
            row = {"step": step, "layer": layer, "load": load, "busiest_share": share}
            self._expert_load_writer.log(row | {"busiest_expert": int(expert), "idle_experts": int(idle)}, "")

    def _executed_flops_of(self, micro_batches: Sequence[dict[str, Tensor]]) -> Tensor:
        """The FLOPs this rank executed on these host micro-batches, counted with host tensor arithmetic
        only (reading a tensor here would cost a step that logs nothing a wait on a GPU)."""
        lengths = torch.cat([attended_lengths(batch) for batch in micro_batches])
        head_tokens = sum((batch["labels"] != -100).sum() for batch in micro_batches)
        executed = self._training_flops.executed(lengths, head_tokens)
        if self._forward_flops is not None:
            executed = executed + self._extra_forward_passes * self._forward_flops.executed(
                lengths, head_tokens
            )
        return executed / self._context

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave a section (validation, checkpointing) out of the tokens/s and MFU measurement. What it
        prints ("Saved checkpoint ...") starts a line of its own: the bar is cleared first and drawn again
        after, where a terminal would otherwise show the message on the bar's line and the bar twice."""
        # In a log file (no terminal) every redraw is more text, and the bar is drawn rarely anyway.
        redraw = self._bar is not None and not self._closed and self._bar_in_terminal
        if redraw:
            self._bar.clear()
        with self._throughput.paused() if self._throughput is not None else contextlib.nullcontext():
            yield
        if redraw and not self._closed:
            self._bar.refresh()

    def log_step(self, step: int, metrics: dict[str, float | Tensor | None]) -> None:
        """Record a log step's training metrics (names from CSV_COLUMNS; tensors are read here, once).

        Args:
            step: Optimizer steps completed.
            metrics: E.g. loss, learning_rate, grad_norm, epoch, and the outputs of `Throughput.compute`
                and `peak_memory`. None or missing values are left blank.
        """
        unknown = sorted(set(metrics) - TRAIN_METRICS)
        if unknown:
            raise ValueError(f"unknown training metrics {unknown}; known: {sorted(TRAIN_METRICS)}")
        if not self.is_global_zero:
            return
        names = [k for k, v in metrics.items() if v is not None]
        values = dict(zip(names, _to_floats([metrics[k] for k in names])))  # type: ignore[misc]
        row: dict[str, float | None] = {k: values.get(k) for k in CSV_COLUMNS}
        row["step"] = step
        self._write(row, "train")
        postfix = [f"loss {values['loss']:.4f}"] if "loss" in values else []
        if "tokens_per_second" in values:
            postfix.append(f"{values['tokens_per_second']:,.0f} tokens/s")
        if "expert_load_layer" in values:
            postfix.append(
                f"expert load {values['expert_load']:.2f} (layer {values['expert_load_layer']:.0f})"
            )
        self._bar.set_postfix_str(", ".join(postfix), refresh=False)

    def validation_done(
        self,
        step: int,
        *,
        loss: float | Tensor,
        tokens: int | Tensor,
        sample: str | None = None,
        objective_means: dict[str, float] | None = None,
    ) -> float:
        """Record a validation and return its perplexity, exp(loss), on every rank.

        Args:
            step: Optimizer steps completed.
            loss: Global mean loss per target token (sum over ranks of per-token losses over the sum of
                tokens, e.g. from `TokenWeightedMean`).
            tokens: Global number of target tokens the loss covers.
            sample: A generated sample, printed and appended to samples.txt.
            objective_means: The objective's logged statistics over the validation data (a preference
                objective's rewards), written as val_<name>.
        """
        val_loss, val_tokens = _to_floats([loss, tokens])
        val_perplexity = perplexity(val_loss)
        if not self.is_global_zero:
            return val_perplexity
        row: dict[str, float | None] = dict.fromkeys(CSV_COLUMNS)
        row.update(step=step, val_loss=val_loss, val_perplexity=val_perplexity, val_tokens=val_tokens)
        row.update({f"val_{name}": value for name, value in (objective_means or {}).items()})
        self._write(row, "val")
        message = f"step {step}: val_loss {val_loss:.4f}, val_perplexity {val_perplexity:.2f}"
        if objective_means and "reward_accuracy" in objective_means:
            message += (
                f", val_reward_accuracy {objective_means['reward_accuracy']:.3f}, "
                f"val_reward_margin {objective_means['reward_margin']:.4f}"
            )
        if sample is not None:
            message += f"\n{sample}"
            with (self.out_dir / SAMPLES_FILENAME).open("a") as f:
                f.write(f"## step {step}\n{sample}\n\n")
            for writer in self._writers:
                writer.log_text("val/sample", sample, step)
        if self._bar.total is not None and self._bar.n >= self._bar.total:
            # The last validation: tqdm.write redraws the bar after the message and close() draws it
            # again, so the finished bar would appear twice; closing it first draws it once.
            self._bar.close()
        self._bar.write(message)
        return val_perplexity

    def tasks_done(self, step: int, results: dict[str, Any]) -> None:
        """Record the scores of `--eval.tasks` at a validation (lm_eval's results): a row per score in
        tasks.csv, `tasks/<task>/<metric>` in TensorBoard and W&B, a panel of loss.png, a printed line, and
        lm_eval's table of the last ones when the run ends."""
        if not self.is_global_zero:
            return
        from litsft.training.eval_tasks import task_scores

        scores = task_scores(results)
        if self._tasks_writer is None:
            self._tasks_writer = CSVWriter(
                self.out_dir, TASK_COLUMNS, self._start_step, {}, filename=TASKS_FILENAME
            )
            kept: dict[int, dict[str, float]] = {}  # a resumed run's earlier scores, for loss.png
            for row in self._tasks_writer.kept_rows:
                step_scores = kept.setdefault(int(row["step"]), {"step": int(row["step"])})
                step_scores[f"{row['task']}/{row['metric']}"] = float(row["value"])
            self.task_history += kept.values()
        for name, value in scores.items():
            task, _, metric = name.partition("/")
            self._tasks_writer.log({"step": step, "task": task, "metric": metric, "value": value}, "")
        for writer in self._writers:
            if not isinstance(writer, CSVWriter):  # metrics.csv has a column per metric it knows
                writer.log({"step": step, **scores}, "tasks")
        self.task_history.append({"step": step, **scores})
        self._last_task_results = step, results
        self._bar.write(f"step {step}: " + ", ".join(f"{name} {value:.4f}" for name, value in scores.items()))

    def update_progress(self, step: int) -> None:
        """Move the progress bar to `step` optimizer steps done; call every step (cheap, no sync)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        """Close the bar and loggers, and write loss.png from the logged rows. Safe to call twice."""
        # Also called from the signal thread (a second Ctrl-C after a stop's checkpoint): one closes at a time.
        with self._close_lock:
            if self._closed or not self.is_global_zero:
                return
            self._closed = True
            self._bar.close()
            if self._last_task_results is not None:
                from lm_eval.utils import make_table

                step, results = self._last_task_results
                print(f"--eval.tasks at step {step}:\n{make_table(results)}", flush=True)
            self._plot()
            for writer in self._writers:
                writer.close()

    def _plot(self) -> None:
        figure = loss_figure(self.history, self.out_dir.name, self.task_history)
        if figure is not None:
            figure.savefig(self.out_dir / PLOT_FILENAME, dpi=100)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
