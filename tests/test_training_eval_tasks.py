"""`--eval.tasks`: lm_eval tasks scored during training on the live model, sharded over 2 processes, equal
`litsft evaluate` on the checkpoint saved at the same step; and the naming of lm_eval's scores."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from launch import TINY_MOE, litsft, litsft_in_process, write_records, write_tiny_checkpoint

from litsft.training.eval_tasks import task_scores

TASKS_DIR = Path(__file__).parent / "fixtures" / "lm_eval_tasks"
TASKS = "litsft_tiny_multiple_choice,litsft_tiny_generate,litsft_tiny_perplexity"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # the tasks read their JSONL files
TASK_OPTIONS = ["--limit", "6", "--num_fewshot", "1", "--apply_chat_template", "true", "--batch_size", "4"]


def test_scores_during_training_equal_litsft_evaluate_on_that_steps_checkpoint(tmp_path: Path) -> None:
    """A mixture of experts on 2 processes with expert parallelism: FSDP2 all-gathers the dense weights and
    tokens travel to their experts' rank in every forward pass, so the ranks' passes must stay in lockstep
    while each scores its own share of the requests."""
    base = write_tiny_checkpoint(tmp_path / "base", seed=1, **TINY_MOE)
    data = write_records(tmp_path / "data.json", count=48)
    out_dir = tmp_path / "run"
    train = [
        "finetune_full", str(base), "--out_dir", str(out_dir), "--devices", "2", "--parallel.expert", "2",
        "--accelerator", "cpu",
        "--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.1",
        "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.max_steps", "3",
        "--train.max_seq_length", "64", "--optimizer.lr", "1e-2", "--precision", "32-true",
        "--eval.interval", "2", "--eval.max_new_tokens", "0", "--train.save_interval", "2",
        "--eval.tasks", TASKS, "--eval.include_path", str(TASKS_DIR),
        *(option.replace("--", "--eval.") for option in TASK_OPTIONS),
    ]  # fmt: skip
    trained = litsft(train, tmp_path, cwd=TASKS_DIR, env=OFFLINE)
    with (out_dir / "tasks.csv").open() as file:
        rows = list(csv.DictReader(file))
    during = {
        step: {f"{r['task']}/{r['metric']}": float(r["value"]) for r in rows if int(r["step"]) == step}
        for step in (2, 3)
    }
    assert sorted({int(r["step"]) for r in rows}) == [2, 3]  # the validation at step 2, and the last one

    after = tmp_path / "evaluate"
    evaluate = [
        "evaluate",
        str(out_dir / "step-00000002"),
        "--tasks",
        TASKS,
        "--include_path",
        str(TASKS_DIR),
    ]
    litsft(
        [*evaluate, *TASK_OPTIONS, "--dtype", "float32", "--out_dir", str(after)],
        tmp_path,
        cwd=TASKS_DIR,
        env=OFFLINE,
    )
    expected = task_scores(json.loads((after / "results.json").read_text()))

    assert during[2].keys() == expected.keys()
    for name, value in expected.items():
        assert during[2][name] == pytest.approx(value, rel=1e-4), name
    assert during[3] != during[2]  # step 3 scored the model after its update
    # The last scores close the run as lm_eval's table; loss.png has their panel.
    assert "--eval.tasks at step 3:" in trained.stdout and "|litsft_tiny_generate " in trained.stdout
    assert (out_dir / "loss.png").is_file()


def test_scores_are_named_task_metric_and_filter() -> None:
    results = {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25},
            "gsm8k": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": "N/A"},
        },
        "groups": {"mmlu": {"acc,none": 0.75, "alias": "mmlu"}},
    }
    assert task_scores(results) == {
        "arc_easy/acc": 0.5,
        "arc_easy/acc_norm": 0.25,
        "gsm8k/exact_match/strict-match": 0.125,
        "mmlu/acc": 0.75,
    }


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture, *eval_options: str) -> str:
    """The one line a finetune_full run with `eval_options` is refused with: exit 2, no out_dir."""
    base = write_tiny_checkpoint(tmp_path / "base", seed=1)
    data = write_records(tmp_path / "data.json", count=8)
    out_dir = tmp_path / "run"
    args = ["finetune_full", str(base), "--data", "JSON", "--data.json_path", str(data)]
    args += ["--out_dir", str(out_dir), *eval_options]
    result = litsft_in_process(args, tmp_path, capsys, check=False, env=OFFLINE)
    assert result.returncode == 2
    assert not out_dir.exists()
    (line,) = result.stderr.splitlines()
    return line


def test_an_unknown_task_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = refusal(
        tmp_path,
        capsys,
        *("--eval.tasks", "litsft_tiny_generate,no_such_task", "--eval.include_path", str(TASKS_DIR)),
    )
    assert line == (
        "error: unknown lm_eval tasks: no_such_task; `lm_eval ls tasks` lists them, and --include_path adds "
        "your own"
    )


def test_a_task_whose_documents_cannot_load_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Found at the start, not at the first validation hours later."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task = (TASKS_DIR / "generate.yaml").read_text().replace("litsft_tiny_generate", "litsft_no_documents")
    (tasks / "no_documents.yaml").write_text(task.replace("generate.jsonl", str(tmp_path / "missing.jsonl")))
    line = refusal(tmp_path, capsys, "--eval.tasks", "litsft_no_documents", "--eval.include_path", str(tasks))
    assert line.startswith("error: --eval.tasks: lm_eval could not load litsft_no_documents (")
    assert line.endswith("fix the task or its dataset, or leave it out")
