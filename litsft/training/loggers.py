"""Where metrics go: one class per back-end (CSV, TensorBoard, W&B) behind the same three calls.

`MetricsLogger` (litsft.training.metrics) builds the ones `--log.loggers` names with `metric_loggers` and hands each
row to all of them; a new back-end is a subclass registered in LOGGERS.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from litsft.errors import LitsftError

LoggerName = Literal["csv", "tensorboard", "wandb"]
CSV_FILENAME = "metrics.csv"


class MetricWriter:
    """One back-end. Rows are dicts of column -> value (None: blank), always with "step"."""

    package: ClassVar[str | None] = None
    """The package the back-end needs, checked before a run starts."""

    def __init__(
        self, out_dir: Path, columns: Sequence[str], start_step: int, run_config: dict[str, Any]
    ) -> None:
        self.out_dir, self.columns = out_dir, tuple(columns)

    def log(self, row: dict[str, float | None], prefix: str) -> None:
        """Write a row of "train" or "val" values."""

    def log_text(self, key: str, text: str, step: int) -> None:
        """Write a piece of text, e.g. a generated sample."""

    def close(self) -> None:
        pass


def _scalars(row: dict[str, float | None], prefix: str) -> dict[str, float]:
    """`train/loss`, `val/loss`, ...: the names TensorBoard and W&B group charts by."""
    return {f"{prefix}/{k.removeprefix('val_')}": v for k, v in row.items() if k != "step" and v is not None}


class CSVWriter(MetricWriter):
    """out_dir/metrics.csv (or `filename`), one row per log step or validation. A resumed run keeps the rows
    up to the step it resumes from (`kept_rows`) and appends."""

    def __init__(
        self,
        out_dir: Path,
        columns: Sequence[str],
        start_step: int,
        run_config: dict[str, Any],
        filename: str = CSV_FILENAME,
    ) -> None:
        super().__init__(out_dir, columns, start_step, run_config)
        self.path = out_dir / filename
        self.kept_rows: list[dict[str, str]] = []
        if start_step > 0 and self.path.is_file():
            with self.path.open(newline="") as f:
                self.kept_rows = [
                    row for row in csv.DictReader(f) if row.get("step") and int(row["step"]) <= start_step
                ]
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.kept_rows)

    def log(self, row: dict[str, float | None], prefix: str) -> None:
        step = int(row["step"])  # type: ignore[arg-type]
        with self.path.open("a", newline="") as f:
            csv_row = {k: "" if v is None else (step if k == "step" else v) for k, v in row.items()}
            csv.DictWriter(f, fieldnames=self.columns).writerow(csv_row)


class TensorBoardWriter(MetricWriter):
    """Event files under out_dir/tensorboard/."""

    package = "tensorboard"

    def __init__(
        self, out_dir: Path, columns: Sequence[str], start_step: int, run_config: dict[str, Any]
    ) -> None:
        super().__init__(out_dir, columns, start_step, run_config)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if run_config:
            text = json.dumps(run_config, indent=2, default=str)
            self.writer.add_text("run_config", f"```\n{text}\n```", start_step)

    def log(self, row: dict[str, float | None], prefix: str) -> None:
        for key, value in _scalars(row, prefix).items():
            self.writer.add_scalar(key, value, int(row["step"]))  # type: ignore[arg-type]
        self.writer.flush()

    def log_text(self, key: str, text: str, step: int) -> None:
        self.writer.add_text(key, text, step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter(MetricWriter):
    """A Weights & Biases run: offline when WANDB_MODE=offline (wandb reads it itself); the project is
    WANDB_PROJECT, else "litsft"."""

    package = "wandb"

    def __init__(
        self, out_dir: Path, columns: Sequence[str], start_step: int, run_config: dict[str, Any]
    ) -> None:
        super().__init__(out_dir, columns, start_step, run_config)
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "litsft"),
            name=out_dir.name,
            dir=str(out_dir),
            config=run_config or {},
        )

    def log(self, row: dict[str, float | None], prefix: str) -> None:
        self.run.log(_scalars(row, prefix), step=int(row["step"]))  # type: ignore[arg-type]

    def log_text(self, key: str, text: str, step: int) -> None:
        self.run.log({key: text}, step=step)

    def close(self) -> None:
        self.run.finish()


LOGGERS: dict[str, type[MetricWriter]] = {
    "csv": CSVWriter,
    "tensorboard": TensorBoardWriter,
    "wandb": WandbWriter,
}


def check_loggers(names: Sequence[str]) -> None:
    """Every named back-end exists and its package is installed (checked on every rank, so that all of them
    fail together instead of rank 0 alone)."""
    for name in names:
        if name not in LOGGERS:
            raise LitsftError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        package = LOGGERS[name].package
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError:
            raise LitsftError(
                f"loggers includes {name!r} but the {package} package is not installed; "
                f"run `pip install {package}` or drop {name!r} from loggers"
            ) from None


def metric_loggers(
    names: Sequence[str], out_dir: Path, columns: Sequence[str], start_step: int, run_config: dict[str, Any]
) -> list[MetricWriter]:
    return [LOGGERS[name](out_dir, columns, start_step, run_config) for name in dict.fromkeys(names)]
