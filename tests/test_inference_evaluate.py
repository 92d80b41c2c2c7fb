"""`litsft evaluate` scores what lm_eval's own Hugging Face model (`lm_eval --model hf`) scores on the same
folder: request by request (log-likelihoods, greedy flags, generated strings, perplexities), plain and through
the chat template, on a tiny random Llama with a 64-token context that few-shot prompts and texts run past.
The tasks are tests/fixtures/lm_eval_tasks/ (their own JSONL data, read from that folder)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import datasets.config
import lm_eval
import lm_eval.tasks
import pytest
import torch
from launch import litsft, litsft_in_process
from lm_eval.tasks import TaskManager
from tiny_hf import save_tiny_hf, tiny_hf_model
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data.tokenizer import Tokenizer

TASKS_DIR = Path(__file__).parent / "fixtures" / "lm_eval_tasks"
MULTIPLE_CHOICE, GENERATE, PERPLEXITY = (
    "litsft_tiny_multiple_choice",
    "litsft_tiny_generate",
    "litsft_tiny_perplexity",
)
CONTEXT = 64
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama in Hugging Face layout. ChatML: no bos; Llama 3: the tokenizer adds bos, and the
    template writes it too (a rendered prompt must not get a second one)."""
    directory = save_tiny_hf(tiny_hf_model("llama", seed=0), tmp_path_factory.mktemp(request.param) / "hf")
    if request.param == "llama3":
        write_tiny_tokenizer(directory, chat_template="llama3")
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT  # truncation, and texts scored in several windows
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(autouse=True)
def task_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Offline, in the tasks' folder (their data paths are relative to it), one thread, the datasets cache
    under tmp_path; and a TaskManager that indexes these tasks only: lm_eval's ~14,000 built-in task files
    take it 17 s to index on a busy 2-core machine, for every run."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASKS_DIR)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", partial(TaskManager, include_defaults=False))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def litsft_evaluate(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, tasks: list[str], *options: str
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], str]:
    """`litsft evaluate` on the HF folder: (results.json, samples by task, stdout)."""
    out_dir = tmp_path / "litsft"
    args = ["evaluate", str(hf_dir), "--tasks", ",".join(tasks), "--include_path", str(TASKS_DIR)]
    args += ["--batch_size", "4", "--dtype", "float32", "--log_samples", "true"]
    result = litsft_in_process([*args, *options, "--out_dir", str(out_dir)], tmp_path, capsys)
    samples = {
        task: [json.loads(line) for line in (out_dir / f"samples_{task}.jsonl").read_text().splitlines()]
        for task in tasks
    }
    return json.loads((out_dir / "results.json").read_text()), samples, result.stdout


def hf_evaluate(hf_dir: Path, tasks: list[str], **options: Any) -> dict[str, Any]:
    """lm_eval's own `hf` model on the same folder, as `lm_eval --model hf` runs it."""
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32",
        device="cpu",
        tasks=tasks,
        batch_size=4,
        task_manager=lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR)),
        log_samples=True,
        **options,
    )
    return json.loads(json.dumps(results, default=str))  # as litsft's files hold them: tuples as lists


def assert_same_requests(ours: list[dict], theirs: list[dict]) -> None:
    """The same prompts, and the same answers request by request: generated text equal, log-likelihoods
    within TOLERANCE and the same greedy flags."""
    ours, theirs = sorted(ours, key=lambda s: s["doc_id"]), sorted(theirs, key=lambda s: s["doc_id"])
    assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]
    largest = 0.0
    for mine, reference in zip(ours, theirs):
        for answer, expected in zip(mine["resps"], reference["resps"], strict=True):
            answer, expected = answer[0], expected[0]
            if isinstance(expected, str):  # generated text
                assert answer == expected
                continue
            if isinstance(expected, list):  # (log-likelihood, greedy)
                assert answer[1] == expected[1]
                answer, expected = answer[0], expected[0]
            largest = max(largest, abs(answer - expected))
    assert largest < TOLERANCE


def test_scores_equal_lm_evals_hf_model_request_by_request(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tasks = [MULTIPLE_CHOICE, GENERATE, PERPLEXITY]
    options = ["--num_fewshot", "2", "--limit", "8"]  # prompts of 2 examples run past the context
    results, samples, stdout = litsft_evaluate(hf_dir, tmp_path, capsys, tasks, *options)
    reference = hf_evaluate(hf_dir, tasks, num_fewshot=2, limit=8)

    for task in tasks:
        assert_same_requests(samples[task], reference["samples"][task])
    ours, theirs = results["results"], reference["results"]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[MULTIPLE_CHOICE][metric] == theirs[MULTIPLE_CHOICE][metric]
    assert ours[GENERATE]["exact_match,none"] == theirs[GENERATE]["exact_match,none"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours[PERPLEXITY][metric] == pytest.approx(theirs[PERPLEXITY][metric], rel=TOLERANCE)
    # The printed table is lm_eval's, one row per metric.
    assert "|litsft_tiny_multiple_choice|" in stdout and "word_perplexity" in stdout
    assert len(samples[MULTIPLE_CHOICE]) == 8
    # Prompts longer than the context were truncated, and a text longer than it scored in several windows.
    tokens = Tokenizer(hf_dir).encode
    assert max(len(tokens(s["arguments"][0][0])) for s in samples[MULTIPLE_CHOICE]) > CONTEXT
    assert max(len(tokens(s["arguments"][0][0])) for s in samples[PERPLEXITY]) > CONTEXT


def test_chat_template_prompts_score_as_lm_evals_hf_model(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Generation prompts end with the template's assistant header; the multiple-choice task starts the reply
    itself ("Answer:"), which ends the prompt inside the assistant turn (transformers' continue_final_message).
    Zero-shot, the prompts fit the context whole, bos included."""
    tasks = [MULTIPLE_CHOICE, GENERATE]
    options = ["--apply_chat_template", "true", "--num_fewshot", "0"]
    _, samples, _ = litsft_evaluate(hf_dir, tmp_path, capsys, tasks, *options)
    reference = hf_evaluate(hf_dir, tasks, apply_chat_template=True, num_fewshot=0)

    for task in tasks:
        assert_same_requests(samples[task], reference["samples"][task])
    prompt = samples[GENERATE][0]["arguments"][0][0]
    assert prompt.endswith("assistant\n") or prompt.endswith("<|end_header_id|>\n\n")
    assert samples[MULTIPLE_CHOICE][0]["arguments"][0][0].endswith("Answer:")


def test_two_processes_score_as_lm_evals_hf_model_in_one(hf_dir: Path, tmp_path: Path) -> None:
    """`--devices 2`: two CPU processes, each with its own copy of the model and half of every task's
    documents; rank 0 gathers them. The same requests and answers as lm_eval's hf model in one process, with
    the chat template."""
    tasks = [MULTIPLE_CHOICE, GENERATE, PERPLEXITY]
    out_dir = tmp_path / "litsft"
    args = ["evaluate", str(hf_dir), "--tasks", ",".join(tasks), "--include_path", str(TASKS_DIR)]
    args += ["--batch_size", "4", "--dtype", "float32", "--log_samples", "true", "--devices", "2"]
    args += ["--apply_chat_template", "true", "--num_fewshot", "1", "--limit", "8", "--out_dir", str(out_dir)]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = litsft(args, tmp_path, cwd=TASKS_DIR, env=env)
    reference = hf_evaluate(hf_dir, tasks, apply_chat_template=True, num_fewshot=1, limit=8)

    for task in tasks:
        samples = [json.loads(line) for line in (out_dir / f"samples_{task}.jsonl").read_text().splitlines()]
        assert len(samples) == 8
        assert_same_requests(samples, reference["samples"][task])
    ours = json.loads((out_dir / "results.json").read_text())["results"]
    theirs = reference["results"]
    assert ours[MULTIPLE_CHOICE]["acc,none"] == theirs[MULTIPLE_CHOICE]["acc,none"]
    assert ours[GENERATE]["exact_match,none"] == theirs[GENERATE]["exact_match,none"]
    assert ours[PERPLEXITY]["word_perplexity,none"] == pytest.approx(
        theirs[PERPLEXITY]["word_perplexity,none"], rel=TOLERANCE
    )
    assert result.stdout.count("|litsft_tiny_multiple_choice|") == 1  # rank 0 prints the table, once


def test_without_lm_eval_it_refuses_in_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    out_dir = tmp_path / "out"
    args = ["evaluate", str(tmp_path / "model"), "--tasks", "hellaswag", "--out_dir", str(out_dir)]
    result = litsft_in_process(args, tmp_path, capsys, check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: the tasks run in lm-evaluation-harness, which is not installed: pip install 'litsft[eval]'"
    ]
    assert not out_dir.exists()


def test_refusals_come_before_the_model_is_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing_model = str(tmp_path / "no-model")

    def refusal(*options: str) -> str:
        args = ["evaluate", missing_model, "--include_path", str(TASKS_DIR), *options]
        result = litsft_in_process(args, tmp_path, capsys, check=False)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        return result.stderr

    assert "--tasks hellaswag,arc_easy" in refusal()
    assert "unknown lm_eval tasks: no_such_task" in refusal("--tasks", f"{GENERATE},no_such_task")
    assert "batch_size=0" in refusal("--tasks", GENERATE, "--batch_size", "0")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "results.json").write_text("earlier results")
    assert "exists already" in refusal("--tasks", GENERATE, "--out_dir", str(out_dir))
    assert (out_dir / "results.json").read_text() == "earlier results"


def test_the_chat_template_option_needs_a_template(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    directory = save_tiny_hf(tiny_hf_model("llama", seed=0), tmp_path / "hf")
    write_tiny_tokenizer(directory, chat_template=None)
    out_dir = tmp_path / "out"
    args = ["evaluate", str(directory), "--tasks", GENERATE, "--include_path", str(TASKS_DIR)]
    args += ["--apply_chat_template", "true", "--out_dir", str(out_dir)]
    result = litsft_in_process(args, tmp_path, capsys, check=False)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert (
        result.stderr.rstrip()
        == f"error: {directory} has no chat template; run without --apply_chat_template"
    )
    assert not out_dir.exists()
