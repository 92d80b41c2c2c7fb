import contextlib
import csv
import io
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import on_ranks

import litsft.training.metrics as metrics
from litsft.errors import LitsftError
from litsft.model.accounting.flops import executed_training_flops
from litsft.model.config import Config
from litsft.training.metrics import CSV_COLUMNS, MetricsLogger, Throughput, TokenWeightedMean, peak_memory

torch.set_num_threads(1)

TINY = Config(
    name="flops", vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throughput_tokens_per_second_and_mfu(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    throughput = Throughput(world_size=2, device=torch.device("cpu"), peak_flops=1e12)
    throughput.update(torch.tensor(1500), torch.tensor(700), torch.tensor(1.5e9, dtype=torch.float64))
    clock.now += 1.0
    with throughput.paused():  # validation: 50 s that must not count
        clock.now += 50.0
    throughput.update(torch.tensor(2500), 900, 2.5e9)
    clock.now += 1.0
    result = throughput.compute()
    # 4000 tokens and 4e9 FLOPs in 2 s on 2 devices of 1e12 FLOP/s: 2e9 FLOP/s / 2e12 = 1e-3.
    assert result == {
        "tokens_per_second": 2000.0,
        "tokens_per_second_per_device": 1000.0,
        "loss_tokens_per_second": 800.0,
        "mfu": 1e-3,
    }
    # The next window starts empty.
    assert throughput.compute() == {}


def test_throughput_without_peak_reports_no_mfu(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    throughput = Throughput(world_size=1, device=torch.device("cpu"), peak_flops=None)
    throughput.update(10, 10, 1e6)
    clock.now += 2.0
    assert throughput.compute()["mfu"] is None


def test_peak_memory_on_cpu_is_process_rss():
    memory = peak_memory(torch.device("cpu"))
    assert set(memory) == {"peak_rss_mib"}
    assert 10 < memory["peak_rss_mib"] < 100_000  # this process holds torch: tens of MiB at least


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_csv_rows_and_blanks(tmp_path):
    with MetricsLogger(tmp_path, is_global_zero=True, total_steps=4, run_config={"lr": 1e-3}) as logger:
        for step in range(1, 5):
            logger.update_progress(step)
        logger.log_step(
            2,
            {
                "loss": torch.tensor(2.5),
                "learning_rate": 1e-3,
                "grad_norm": torch.tensor(0.75),
                "epoch": 0,
                "tokens_per_second": 2000.0,
                "tokens_per_second_per_device": 1000.0,
                "mfu": None,  # unknown device
                "peak_rss_mib": 321.0,
            },
        )
        perplexity = logger.validation_done(
            2, loss=torch.tensor(2.0), tokens=torch.tensor(96), sample="Hello there"
        )
    assert perplexity == math.exp(2.0)
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert tuple(header) == CSV_COLUMNS
    train, val = rows
    assert train["step"] == "2"
    assert float(train["loss"]) == 2.5
    assert float(train["grad_norm"]) == 0.75
    assert float(train["tokens_per_second_per_device"]) == 1000.0
    assert train["mfu"] == "" and train["val_loss"] == "" and train["peak_gpu_memory_allocated_mib"] == ""
    assert val["step"] == "2" and val["loss"] == ""
    assert float(val["val_loss"]) == 2.0
    assert float(val["val_perplexity"]) == math.exp(2.0)
    assert float(val["val_tokens"]) == 96
    assert (tmp_path / "samples.txt").read_text() == "## step 2\nHello there\n\n"
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_step_done_logs_window_loss_throughput_and_mfu(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    logger = MetricsLogger(tmp_path, is_global_zero=True, total_steps=4)
    logger.set_model(TINY, world_size=1, device=torch.device("cpu"), precision="bf16-mixed", peak_flops=1e9)
    # (loss per target token, target tokens, input tokens) of four steps, logged every second step.
    steps = [(2.0, 10, 12), (4.0, 30, 32), (1.0, 5, 8), (1.0, 5, 8)]
    for step, (loss, target_tokens, input_tokens) in enumerate(steps, start=1):
        clock.now += 1.0
        logger.step_done(
            step,
            epoch=0,
            loss=torch.tensor(loss),
            learning_rate=0.1 * step,
            grad_norm=torch.tensor(0.5),
            target_tokens=torch.tensor(target_tokens),
            input_tokens=torch.tensor(input_tokens),
            micro_batches=[unpacked_rows(rows=1, length=input_tokens, loss_tokens=target_tokens)],
            log=step % 2 == 0,
        )
        if step == 2:
            with logger.paused():  # a validation taking 100 s does not dilute the next window
                clock.now += 100.0
    logger.close()
    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["2", "4"]
    first, second = rows
    assert float(first["loss"]) == (2.0 * 10 + 4.0 * 30) / 40  # token-weighted over the window: 3.5
    assert float(first["learning_rate"]) == pytest.approx(0.2)
    assert float(first["tokens_per_second"]) == (12 + 32) / 2
    assert float(first["loss_tokens_per_second"]) == 40 / 2
    step_flops = [executed_training_flops(TINY, [tokens], target) for _, target, tokens in steps[:2]]
    assert float(first["mfu"]) == pytest.approx(sum(step_flops) / 2 / 1e9)
    assert float(second["loss"]) == 1.0
    assert float(second["tokens_per_second"]) == 16 / 2
    assert float(first["peak_rss_mib"]) > 0 and first["peak_gpu_memory_allocated_mib"] == ""


def unpacked_rows(rows: int, length: int, loss_tokens: int) -> dict[str, torch.Tensor]:
    """A micro-batch of `rows` unpacked rows of `length` tokens, the first `loss_tokens` of each carrying a loss."""
    labels = torch.full((rows, length), -100)
    labels[:, :loss_tokens] = 1
    return {"input_ids": torch.ones(rows, length, dtype=torch.long), "labels": labels}


def packed_row(lengths: list[int], padding: int, loss_tokens: int) -> dict[str, torch.Tensor]:
    """A packed row of documents of these lengths then `padding` positions, as the loader collates it; the
    first `loss_tokens` positions carry a loss."""
    from litsft.model.network.attention import cumulative_lengths

    row = unpacked_rows(1, sum(lengths) + padding, loss_tokens)
    document_ids = torch.cat(
        [torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((padding,), -1)]
    )
    return row | {
        "document_ids": document_ids[None],
        "position_ids": torch.cat(
            [torch.arange(n) for n in lengths] + [torch.zeros(padding, dtype=torch.long)]
        )[None],
        "cu_seqlens": cumulative_lengths(lengths),
        "max_seqlen": torch.tensor(max(lengths)),
    }


@pytest.mark.parametrize(
    "micro_batches, expected_flops",
    [
        # Documents of 5, 2 and 3 tokens then 2 of padding, 7 loss tokens: the blocks on the 10 real tokens,
        # the head on the 7, attention on each document's causal pairs, 15 + 3 + 6, in each of 2 layers.
        (
            [packed_row([5, 2, 3], padding=2, loss_tokens=7)],
            6 * 240 * 10 + 6 * 40 * 7 + 3 * 4 * 4 * 2 * (15 + 3 + 6),
        ),
        # Two micro-batches of a step add up.
        (
            [packed_row([5, 2, 3], padding=2, loss_tokens=7), packed_row([12], padding=0, loss_tokens=1)],
            6 * 240 * 22 + 6 * 40 * 8 + 3 * 4 * 4 * 2 * (15 + 3 + 6 + 78),
        ),
        # Unpacked rows are attended whole: 2 rows of 6 tokens, 3 loss tokens each.
        (
            [unpacked_rows(rows=2, length=6, loss_tokens=3)],
            6 * 240 * 12 + 6 * 40 * 6 + 3 * 4 * 4 * 2 * (21 + 21),
        ),
    ],
)
def test_mfu_counts_the_flops_the_documents_of_a_step_execute(
    tmp_path, monkeypatch, micro_batches, expected_flops
):
    """TINY's blocks have 240 matmul weights (2 layers of 120), its head 40, H * D = 4: a trained weight costs
    6 FLOPs a token, an attention pair 3 * 4 * H * D a layer. MFU is these FLOPs over the time and the peak.
    Crediting every token with attention over the whole row of 12 (flops_per_token) overstated the first
    step by 54%: 28,320 FLOPs for 18,384."""
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    logger = MetricsLogger(tmp_path, is_global_zero=True)
    logger.set_model(TINY, world_size=1, device=torch.device("cpu"), precision="bf16-mixed", peak_flops=1e6)
    clock.now += 0.5
    logger.step_done(
        1, epoch=0, loss=1.0, learning_rate=0.1, grad_norm=None, target_tokens=7, input_tokens=10,
        micro_batches=micro_batches, log=True,
    )  # fmt: skip
    logger.close()
    _, (row,) = read_csv(tmp_path / "metrics.csv")
    assert float(row["mfu"]) == pytest.approx(expected_flops / 0.5 / 1e6, rel=1e-6)


def test_no_mfu_on_an_unknown_device(tmp_path):
    logger = MetricsLogger(tmp_path, is_global_zero=True)
    logger.set_model(TINY, world_size=1, device=torch.device("cpu"), precision="bf16-mixed")
    logger.step_done(
        1, epoch=0, loss=1.0, learning_rate=0.1, grad_norm=None, target_tokens=4, input_tokens=4,
        micro_batches=[unpacked_rows(rows=1, length=4, loss_tokens=4)], log=True,
    )  # fmt: skip
    logger.close()
    _, (row,) = read_csv(tmp_path / "metrics.csv")
    assert float(row["tokens_per_second"]) > 0
    assert row["mfu"] == "" and row["grad_norm"] == ""


def test_unknown_metric_name_is_rejected(tmp_path):
    logger = MetricsLogger(tmp_path, is_global_zero=True)
    with pytest.raises(ValueError, match=r"unknown training metrics \['lr'\]"):
        logger.log_step(1, {"lr": 1e-3})
    logger.close()


def test_resume_keeps_rows_up_to_start_step(tmp_path):
    with MetricsLogger(tmp_path, is_global_zero=True) as logger:
        for step in (1, 2, 3):
            logger.log_step(step, {"loss": float(step)})
    # Resuming from the checkpoint at step 2: the row logged after it is dropped, then logging goes on.
    with MetricsLogger(tmp_path, is_global_zero=True, start_step=2) as logger:
        logger.log_step(3, {"loss": 30.0})
    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [(r["step"], float(r["loss"])) for r in rows] == [("1", 1.0), ("2", 2.0), ("3", 30.0)]
    assert [r["loss"] for r in logger.history] == [1.0, 2.0, 30.0]


def test_a_mixture_of_experts_logs_its_least_balanced_layer_and_every_layers_balance(tmp_path):
    """metrics.csv gets the highest load (busiest expert over the mean) and its layer; expert_load.csv a row
    per layer per log step, kept up to the step a resumed run starts after."""
    # 3 layers of 4 experts: even; 10 of 16 assignments on expert 0 and none on expert 3; 6 of 16 on expert 1.
    expert_tokens = torch.tensor([[4.0, 4.0, 4.0, 4.0], [10.0, 2.0, 4.0, 0.0], [2.0, 6.0, 6.0, 2.0]])

    def log(logger: MetricsLogger, step: int, scale: float) -> None:
        routing = {"router_aux_loss": torch.tensor(2.25), "expert_tokens": expert_tokens * scale}
        logger.step_done(
            step,
            epoch=0,
            loss=torch.tensor(1.0),
            learning_rate=0.1,
            grad_norm=None,
            target_tokens=torch.tensor(8),
            input_tokens=torch.tensor(8),
            micro_batches=[],
            log=True,
            routing=routing,
        )

    with MetricsLogger(tmp_path, is_global_zero=True) as logger:
        log(logger, 1, 1.0)
        log(logger, 2, 2.0)
    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [(float(r["expert_load"]), r["expert_load_layer"]) for r in rows] == [(2.5, "1.0")] * 2
    assert float(rows[0]["router_aux_loss"]) == 2.25
    header, layers = read_csv(tmp_path / "expert_load.csv")
    assert tuple(header) == metrics.EXPERT_LOAD_COLUMNS
    assert [tuple(r.values()) for r in layers[:3]] == [
        ("1", "0", "1.0", "0.25", "0", "0"),
        ("1", "1", "2.5", "0.625", "0", "1"),
        ("1", "2", "1.5", "0.375", "1", "0"),
    ]
    assert [r["step"] for r in layers] == ["1"] * 3 + ["2"] * 3
    with MetricsLogger(tmp_path, is_global_zero=True, start_step=1) as logger:  # resumed after step 1
        log(logger, 2, 0.5)
    _, layers = read_csv(tmp_path / "expert_load.csv")
    assert [r["step"] for r in layers] == ["1"] * 3 + ["2"] * 3


def test_other_ranks_write_nothing(tmp_path):
    out_dir = tmp_path / "run"
    with MetricsLogger(out_dir, is_global_zero=False, total_steps=2) as logger:
        logger.update_progress(1)
        logger.log_step(1, {"loss": torch.tensor(1.0)})
        perplexity = logger.validation_done(1, loss=0.5, tokens=10, sample="text")
    assert perplexity == math.exp(0.5)
    assert not out_dir.exists()


def test_logger_choices_are_checked(tmp_path, monkeypatch):
    with pytest.raises(LitsftError, match=r"^unknown logger 'mlflow'; choose from csv, tensorboard, wandb$"):
        MetricsLogger(tmp_path, is_global_zero=True, loggers=["csv", "mlflow"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(
        LitsftError,
        match=r"^loggers includes 'tensorboard' but the tensorboard package is not installed; "
        r"run `pip install tensorboard` or drop 'tensorboard' from loggers$",
    ):
        MetricsLogger(tmp_path, is_global_zero=False, loggers=["tensorboard"])


# Two "ranks": (per-token loss sum, label tokens) of each batch. Rank 1 has few tokens with a high loss,
# so the mean of per-rank means (2.75) differs from the token-weighted mean.
RANK_BATCHES = [[(10.0, 10), (30.0, 10)], [(8.0, 2)]]
GLOBAL_MEAN = (10.0 + 30.0 + 8.0) / (10 + 10 + 2)


def test_token_weighted_mean_merged_across_ranks():
    ranks = [TokenWeightedMean() for _ in RANK_BATCHES]
    for metric, batches in zip(ranks, RANK_BATCHES):
        for loss_sum, tokens in batches:
            metric.update(torch.tensor(loss_sum), torch.tensor(tokens))
    ranks[0].merge_state(ranks[1])
    assert ranks[0].compute().item() == pytest.approx(GLOBAL_MEAN, rel=1e-6)
    assert GLOBAL_MEAN != pytest.approx((2.0 + 4.0) / 2)


RANK_FLOPS = [3e6, 1e6]  # what each rank's documents executed in one step


def _merged_loss_and_mfu() -> tuple[float, float]:
    rank = dist.get_rank()
    metric = TokenWeightedMean()
    for loss_sum, tokens in RANK_BATCHES[rank]:
        metric.update(torch.tensor(loss_sum), tokens)
    clock = FakeClock()
    metrics.time.perf_counter = clock  # this forked process's own module
    throughput = Throughput(world_size=2, device=torch.device("cpu"), peak_flops=1e6)
    throughput.update(10, 10, torch.tensor(RANK_FLOPS[rank], dtype=torch.float64))
    clock.now += 1.0
    return metric.compute().item(), throughput.compute()["mfu"]


def test_token_weighted_mean_and_executed_flops_all_reduce_over_a_process_group(tmp_path):
    """Both ranks log the global loss and the MFU of both ranks' FLOPs: 4e6 in 1 s on 2 devices of 1e6."""
    computed = on_ranks(2, _merged_loss_and_mfu, tmp_path)
    for rank in (0, 1):
        assert computed[rank] == pytest.approx((GLOBAL_MEAN, sum(RANK_FLOPS) / 2e6), rel=1e-6)


class Terminal(io.StringIO):
    """stdout and stderr of a run in one terminal: what is left on screen after carriage returns."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        lines = []
        for line in self.getvalue().split("\n"):
            shown: list[str] = []
            column = 0
            for part in line.split("\r"):
                shown[column : column + len(part)] = part
                column = 0
            lines.append("".join(shown).rstrip())
        return lines


def test_a_line_printed_at_a_checkpoint_takes_a_line_of_its_own_and_the_bar_shows_once(tmp_path):
    terminal = Terminal()
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        logger = MetricsLogger(tmp_path, is_global_zero=True, total_steps=2)
        logger.set_model(TINY, world_size=1, device=torch.device("cpu"), precision="32-true")
        for step in (1, 2):
            logger.step_done(step, epoch=0, loss=1.0, learning_rate=0.1, grad_norm=None, target_tokens=4,
                             input_tokens=4, micro_batches=[unpacked_rows(1, 4, 4)], log=True)  # fmt: skip
            logger._bar.refresh()  # as a redraw after mininterval would
            with logger.paused():
                print(f"Saved checkpoint step-{step}", flush=True)
        logger.close()
    screen = terminal.screen()
    assert "Saved checkpoint step-1" in screen and "Saved checkpoint step-2" in screen, screen
    assert sum("2/2 [" in line for line in screen) == 1, screen


def test_the_loss_plot_marks_whole_steps() -> None:
    rows = [dict.fromkeys(CSV_COLUMNS) | {"step": step, "loss": 3.0 - step} for step in (1, 2, 3)]
    figure = metrics.loss_figure(rows, "run")
    figure.canvas.draw()
    ticks = figure.axes[0].get_xticks()
    assert len(ticks) > 1 and all(tick == int(tick) for tick in ticks), ticks


def test_a_context_rank_counts_its_share_of_the_flops_of_the_micro_batches_its_group_shares(
    tmp_path, monkeypatch
):
    """The ranks of a context group are handed the same micro-batches and each executes 1/context of their
    work: summed over the group, the step's FLOPs are counted once (MFU would be 2x too high otherwise)."""
    batch = {
        "input_ids": torch.zeros(1, 12, dtype=torch.long),
        "labels": torch.zeros(1, 12, dtype=torch.long),
    }
    mfus = []
    for context in (1, 2):
        clock = FakeClock()
        monkeypatch.setattr(metrics.time, "perf_counter", clock)
        out = tmp_path / f"context{context}"
        logger = MetricsLogger(out, is_global_zero=True)
        logger.set_model(
            TINY,
            world_size=1,
            device=torch.device("cpu"),
            precision="bf16-mixed",
            peak_flops=1e6,
            context=context,
        )
        clock.now += 0.5
        logger.step_done(
            1, epoch=0, loss=1.0, learning_rate=0.1, grad_norm=None, target_tokens=12, input_tokens=12,
            micro_batches=[batch], log=True,
        )  # fmt: skip
        logger.close()
        _, (row,) = read_csv(out / "metrics.csv")
        mfus.append(float(row["mfu"]))
    assert mfus[1] == pytest.approx(mfus[0] / 2, rel=1e-9)


def test_task_scores_go_to_tasks_csv_tensorboard_a_panel_of_the_plot_and_the_closing_table(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from test_training_loggers import tensorboard_events

    def results(accuracy: float) -> dict:
        entries = {"alias": "arc_easy", "acc,none": accuracy, "acc_stderr,none": "N/A"}
        return {"results": {"arc_easy": entries}, "versions": {"arc_easy": 1.0}, "n-shot": {"arc_easy": 0},
                "higher_is_better": {"arc_easy": {"acc": True}}, "configs": {"arc_easy": {}}}  # fmt: skip

    logger = MetricsLogger(tmp_path, is_global_zero=True, loggers=["csv", "tensorboard"], total_steps=4)
    logger.log_step(2, {"loss": 2.0})
    logger.tasks_done(2, results(0.25))
    logger.validation_done(2, loss=1.5, tokens=10)
    logger.tasks_done(4, results(0.5))
    logger.close()

    rows = (tmp_path / metrics.TASKS_FILENAME).read_text().splitlines()
    assert rows == ["step,task,metric,value", "2,arc_easy,acc,0.25", "4,arc_easy,acc,0.5"]
    scalars, _ = tensorboard_events(tmp_path / "tensorboard")
    assert scalars["tasks/arc_easy/acc"] == [(2, 0.25), (4, 0.5)]
    assert logger.task_history == [{"step": 2, "arc_easy/acc": 0.25}, {"step": 4, "arc_easy/acc": 0.5}]
    figure = metrics.loss_figure(logger.history, "run", logger.task_history)
    assert [axes.get_title() for axes in figure.axes] == ["run", "--eval.tasks"]
    assert (tmp_path / metrics.PLOT_FILENAME).is_file()
    out = capsys.readouterr()
    assert "step 2: arc_easy/acc 0.2500" in out.out + out.err
    assert "--eval.tasks at step 4:" in out.out and "|arc_easy|" in out.out.replace(" ", "")

    # Resumed after step 2: the scores up to it are kept, in tasks.csv and in the plot's panel.
    resumed = MetricsLogger(tmp_path, is_global_zero=True, loggers=["csv"], total_steps=6, start_step=2)
    resumed.tasks_done(6, results(0.75))
    resumed.close()
    rows = (tmp_path / metrics.TASKS_FILENAME).read_text().splitlines()
    assert rows == ["step,task,metric,value", "2,arc_easy,acc,0.25", "6,arc_easy,acc,0.75"]
    assert resumed.task_history == [{"step": 2, "arc_easy/acc": 0.25}, {"step": 6, "arc_easy/acc": 0.75}]
