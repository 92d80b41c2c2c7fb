"""litsft/training/loggers.py: what each back-end writes (metrics.csv row by row, charts named train/... and val/...),
a resumed CSV keeping its earlier rows, and the back-ends checked before a run. TensorBoard's event files and
W&B's offline run file are read back (TensorBoard's own reader; W&B's record log by the format its writer
defines), alone and from a training run that writes all three back-ends."""

from __future__ import annotations

import csv
import json
import struct
import sys
import time
from pathlib import Path

import pytest
from launch import DEADLINE_S

from litsft.errors import LitsftError
from litsft.training.loggers import (
    CSV_FILENAME,
    LOGGERS,
    CSVWriter,
    MetricWriter,
    TensorBoardWriter,
    WandbWriter,
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


# ---- TensorBoard and W&B, read back ------------------------------------------------------------------------
ROWS = [
    ({"step": 1, "loss": 2.5, "val_loss": None}, "train"),
    ({"step": 2, "loss": 2.0, "val_loss": None}, "train"),
    ({"step": 2, "val_loss": 2.25}, "val"),
]


def tensorboard_events(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """Scalars (tag -> [(step, value)]) and texts (tag -> [text]) of the event files under log_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # add_text is stored as a string tensor under the tag with the "/text_summary" suffix.
    texts = {
        tag.removesuffix("/text_summary"): [
            e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }
    return scalars, texts


WANDB_BLOCK = 32 * 1024
WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


def wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline W&B run file (run-<id>.wandb). Its layout is LevelDB's log format
    under a 7-byte header (wandb's datastore: https://github.com/wandb/wandb/blob/v0.16.0/wandb/sdk/internal/datastore.py):
    32 KiB blocks of records, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last), a block's tail shorter than a header left as zeros."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    if not data:
        return []  # created, nothing written yet
    assert data[: len(WANDB_HEADER)] == WANDB_HEADER
    position, parts, records = len(WANDB_HEADER), [], []
    while position + 7 <= len(data):
        if WANDB_BLOCK - position % WANDB_BLOCK < 7:
            position += WANDB_BLOCK - position % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if position + 7 + length > len(data):
            break  # being written
        parts.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
        elif kind == 0:
            parts = []
    return records


def wandb_history(out_dir: Path) -> tuple[dict[int, dict[str, object]], dict[str, object], str]:
    """What an offline W&B run under out_dir logged: step -> {key: value} without wandb's own `_` keys, the
    run's config, and its name."""
    (run_file,) = out_dir.glob("wandb/offline-run-*/run-*.wandb")
    # `finish()` returns once wandb's service has the run; the service writes the file's last records after
    # that (measured: read at once, the history was missing in 4 runs of 8, the whole file empty in 4 of 6), ending with the exit record.
    deadline = time.monotonic() + DEADLINE_S
    while not (records := wandb_records(run_file)) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {DEADLINE_S} s"
        time.sleep(0.1)
    history, config, name = {}, {}, None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # A key is stored whole in `key` or, in some versions, as the one part of `nested_key`.
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            name = record.run.display_name
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"}
    return history, config, name


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline, its settings and caches in tmp_path: nothing leaves the machine or touches ~/.config."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def test_tensorboard_writes_scalars_by_prefix_the_run_config_and_samples(tmp_path: Path) -> None:
    writer = TensorBoardWriter(tmp_path, COLUMNS, start_step=0, run_config={"lr": 0.1})
    for row, prefix in ROWS:
        writer.log(row, prefix)
    writer.log_text("val/sample", "owl pear ship", 2)
    writer.close()
    scalars, texts = tensorboard_events(tmp_path / "tensorboard")
    assert scalars == {"train/loss": [(1, 2.5), (2, 2.0)], "val/loss": [(2, 2.25)]}
    assert texts == {"run_config": ['```\n{\n  "lr": 0.1\n}\n```'], "val/sample": ["owl pear ship"]}


def test_wandb_offline_logs_scalars_by_prefix_the_run_config_and_samples(
    tmp_path: Path, wandb_offline
) -> None:
    writer = WandbWriter(tmp_path / "run-7", COLUMNS, start_step=0, run_config={"lr": 0.1})
    for row, prefix in ROWS:
        writer.log(row, prefix)
    writer.log_text("val/sample", "owl pear ship", 2)
    writer.close()
    history, config, name = wandb_history(tmp_path / "run-7")
    assert history == {
        1: {"train/loss": 2.5},
        2: {"train/loss": 2.0, "val/loss": 2.25, "val/sample": "owl pear ship"},
    }
    assert (config, name) == ({"lr": 0.1}, "run-7")


def test_a_run_writes_the_same_values_to_csv_tensorboard_and_wandb(
    tmp_path: Path, capsys, wandb_offline
) -> None:
    """A one-process training run with all three back-ends: every train and validation value of metrics.csv is
    in TensorBoard and in W&B at its step, under train/ and val/."""
    from crash_harness import train_args
    from launch import litsft_in_process, write_records, write_tiny_checkpoint

    out_dir = tmp_path / "out"
    args = train_args(write_tiny_checkpoint(tmp_path / "base"), write_records(tmp_path / "data.json"), out_dir,
                      "--devices", "1", "--train.max_steps", "4", "--eval.interval", "2",
                      "--log.loggers", "[csv, tensorboard, wandb]")  # fmt: skip
    litsft_in_process(args, tmp_path, capsys)
    expected: dict[tuple[str, int], float] = {}
    for row in rows(out_dir):
        for column in ("loss", "val_loss"):
            if row.get(column):
                prefix = "val" if column == "val_loss" else "train"
                expected[(f"{prefix}/loss", int(row["step"]))] = float(row[column])
    assert {key for key, _ in expected} == {"train/loss", "val/loss"} and len(expected) >= 6

    scalars, _ = tensorboard_events(out_dir / "tensorboard")
    history, _, _ = wandb_history(out_dir)
    for (key, step), value in expected.items():
        assert dict(scalars[key])[step] == pytest.approx(value, rel=1e-6), (key, step)
        assert history[step][key] == pytest.approx(value, rel=1e-6), (key, step)
