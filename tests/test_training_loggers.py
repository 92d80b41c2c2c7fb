"""litsft/training/loggers.py: what each back-end writes (metrics.csv row by row, charts named train/... and val/...),
a resumed CSV keeping its earlier rows, and the back-ends checked before a run."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from litsft.errors import LitsftError
from litsft.training.loggers import (
    CSV_FILENAME,
    LOGGERS,
    CSVWriter,
    MetricWriter,
    _scalars,
    check_loggers,
    metric_loggers,
)

COLUMNS = ("step", "loss", "val_loss")


def rows(out_dir: Path) -> list[dict[str, str]]:
    with (out_dir / CSV_FILENAME).open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_writes_a_header_then_one_row_per_call_with_blanks(tmp_path: Path) -> None:
    writer = CSVWriter(tmp_path, COLUMNS, start_step=0, run_config={})
    writer.log({"step": 1.0, "loss": 2.5, "val_loss": None}, "train")
    writer.log({"step": 2, "val_loss": 2.25}, "val")
    assert (tmp_path / CSV_FILENAME).read_text().splitlines() == ["step,loss,val_loss", "1,2.5,", "2,,2.25"]


def test_a_resumed_csv_keeps_the_rows_up_to_the_step_it_resumes_from(tmp_path: Path) -> None:
    writer = CSVWriter(tmp_path, COLUMNS, start_step=0, run_config={})
    for step in (1, 2, 3, 4):
        writer.log({"step": step, "loss": float(step)}, "train")
    # The run stopped after step 4 but its last checkpoint is step 2: steps 3 and 4 are trained again.
    resumed = CSVWriter(tmp_path, COLUMNS, start_step=2, run_config={})
    resumed.log({"step": 3, "loss": 30.0}, "train")
    assert [(r["step"], r["loss"]) for r in rows(tmp_path)] == [("1", "1.0"), ("2", "2.0"), ("3", "30.0")]
    CSVWriter(tmp_path, COLUMNS, start_step=0, run_config={})  # a fresh start begins a fresh file
    assert rows(tmp_path) == []


def test_charts_are_grouped_by_prefix_and_blanks_left_out() -> None:
    scalars = _scalars({"step": 5, "loss": 1.5, "val_loss": 2.0, "mfu": None}, "val")
    assert scalars == {"val/loss": 2.0}  # `val_loss` and `loss` under val/ would collide: val_ is dropped
    assert _scalars({"step": 5, "loss": 1.5, "tokens_per_second": 10.0}, "train") == {
        "train/loss": 1.5,
        "train/tokens_per_second": 10.0,
    }


def test_each_named_back_end_is_built_once(tmp_path: Path) -> None:
    writers = metric_loggers(["csv", "csv"], tmp_path, COLUMNS, 0, {})
    assert [type(w) for w in writers] == [CSVWriter]


def test_unknown_or_uninstalled_back_ends_are_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LitsftError, match="unknown logger 'mlflow'; choose from csv, tensorboard, wandb"):
        check_loggers(["csv", "mlflow"])

    class Missing(MetricWriter):
        package = "litsft_no_such_package"

    monkeypatch.setitem(LOGGERS, "missing", Missing)
    monkeypatch.setitem(sys.modules, "litsft_no_such_package", None)  # importing it raises ImportError
    with pytest.raises(
        LitsftError, match="the litsft_no_such_package package is not installed; run `pip install"
    ):
        check_loggers(["missing"])
    check_loggers(["csv"])
