"""benchmarks/gpu/run.sh (run.py) and benchmarks/gpu/prepare_wheels.py without a GPU or a network: the dry run, a
step killed at its budget, the summary and its targets, and the wheel download from a local folder of tiny wheels
with its size and content checks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest
from launch import DEADLINE_S

REPO = Path(__file__).resolve().parents[1]


def load(path: str, name: str):
    """A script of benchmarks/gpu as a module (that folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_run = load("benchmarks/gpu/run.py", "gpu_run")
prepare_wheels = load("benchmarks/gpu/prepare_wheels.py", "prepare_wheels")

STEP_NAMES = [
    "install", "environment", "torch_api", "gpu_tests", "cpu_subset_on_cuda", "bench_gpu", "context_parallel",
    "async_save", "demo",
]  # fmt: skip


def test_the_dry_run_prints_every_step_and_budget_and_writes_nothing(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh"), "--dry-run", str(out_dir)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    budgets = {}
    for line in result.stdout.splitlines():
        words = line.split()
        if words and words[0] in [*STEP_NAMES, "total"]:
            budgets[words[0]] = int(words[1])
    assert list(budgets) == [*STEP_NAMES, "total"]
    assert budgets["total"] == sum(budgets[name] for name in STEP_NAMES) <= 480
    assert budgets["bench_gpu"] >= 200  # four training runs with compilation
    assert f"--results_json {out_dir}/bench_gpu.json" in result.stdout
    assert f"--device cuda --repeats 2 --results_json {out_dir}/async_save.json" in result.stdout
    assert (
        f"--context_sizes 1 2 --max_seq_length 32768 --steps 10 --warmup 3 --records 1000 "
        f"--results_json {out_dir}/context_parallel.json --work_dir {gpu_run.WORK_DIR}/work/context"
    ) in result.stdout
    assert (
        f"--work_dir {gpu_run.WORK_DIR}/work/bench" in result.stdout
    )  # the 5 GB checkpoint stays out of OUT_DIR
    assert "pytest -q -p no:cacheprovider" in result.stdout and " -m gpu " in result.stdout
    assert "--no-index --no-deps --no-compile --target" in result.stdout
    assert not out_dir.exists()


def test_only_runs_install_and_the_steps_it_names_optional_ones_included(tmp_path: Path) -> None:
    def planned(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO / "benchmarks/gpu/run.sh"), "--dry-run", *args, str(tmp_path / "out")],
            capture_output=True,
            text=True,
        )

    def names(result: subprocess.CompletedProcess) -> list[str]:
        return [line.split()[0] for line in result.stdout.splitlines() if line[:1].isalpha()][1:]

    assert "moe" not in names(planned())  # optional: not in the eight minutes of the default run
    only = planned("--only", "moe,environment")
    assert names(only) == ["install", "environment", "moe", "total"]
    assert (
        f"--moe_layers 2 --steps 16 --warmup 6 --max_seq_length 4096 --records 1000 --results_json {tmp_path}/out/moe.json"
        in only.stdout
    )
    unknown = planned("--only", "bench")
    assert unknown.returncode == 1 and unknown.stderr.startswith(
        "error: --only names no step bench; the steps are install, "
    )
    assert len(unknown.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_without_an_output_folder_it_says_so_in_one_line(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run.sh")], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr == "error: no OUT_DIR given and $OUT is not set; pass the folder to write into\n"
    assert list(tmp_path.iterdir()) == []


def test_a_step_past_its_budget_is_killed_with_its_children(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    started = time.monotonic()
    step = gpu_run.Step("slow", 2, "sleep 30 & echo $!; sleep 30; echo never", "a step that hangs")
    result = gpu_run.run_step(step, 1, tmp_path, {"PATH": "/usr/bin:/bin"}, tmp_path)
    assert result.status == "timed out" and time.monotonic() - started < 10
    lines = (tmp_path / result.log).read_text().splitlines()
    assert len(lines) == 2  # the command, the background child's pid; never "never"
    stat = Path(f"/proc/{lines[1]}/stat")

    def gone() -> bool:  # or a zombie, until whoever adopted it reaps it
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + DEADLINE_S  # a loaded machine may take a while to deliver the signal
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()  # the background child went with the group
    failed = gpu_run.run_step(
        gpu_run.Step("fails", 5, "exit 3", ""), 2, tmp_path, {"PATH": "/usr/bin:/bin"}, tmp_path
    )
    assert failed.status == "failed (3)"


def test_a_failed_install_stops_the_run_and_the_summary_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    plan = [gpu_run.Step("install", 5, "exit 1", ""), gpu_run.Step("environment", 5, "echo hi", "")]
    monkeypatch.setattr(gpu_run, "steps", lambda out_dir, work_dir, python: plan)
    monkeypatch.setattr(gpu_run, "WORK_DIR", tmp_path / "work-dir")
    assert gpu_run.main([str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "results.json").read_text())
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [
        ("install", "failed (1)"),
        ("environment", "not run"),
    ]
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(
        "| litsft plan / measured peak, finetune_lora | — | 0.90-1.10 | — |"
    )  # last
    assert "| install | 5 |" in (tmp_path / "results.md").read_text()


def write_junit(path: Path, tests: int, failures: int, skipped: int) -> None:
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
        f'errors="0" skipped="{skipped}"></testsuite></testsuites>'
    )


def test_the_summary_tables_the_figures_and_judges_each_target(tmp_path: Path) -> None:
    bench = {
        "device": "NVIDIA H100 80GB HBM3",
        "runs": {
            "finetune_full": {"tokens_per_second": 40000.0, "mfu": 0.42, "peak_mib": 30000.0,
                              "planned_peak_mib": 31000.0, "plan_over_measured": 31000 / 30000},
            "transformers_loop": {"tokens_per_second": 30000.0, "mfu": 0.35, "peak_mib": 32000.0},
            "finetune_lora_r16": {"tokens_per_second": 52000.0, "mfu": 0.3, "peak_mib": 20000.0,
                                  "planned_peak_mib": 24000.0, "plan_over_measured": 1.2},
            "finetune_full_float8_tensorwise": {"tokens_per_second": 46000.0, "mfu": 0.48, "peak_mib": 30000.0},
        },
        "full_over_transformers_loop": 40000 / 30000,
        "lora_over_full": 1.3,
        "full_minus_lora_peak_mib": 10000.0,
        "fp32_base_copy_mib": 4714.0,
        "float8_over_full": 1.15,
        "float8_loss_max_relative_difference": 0.004,
    }  # fmt: skip
    (tmp_path / "bench_gpu.json").write_text(json.dumps(bench))
    saves = {
        "checkpoint_gb": 1.35,
        "saves": {
            "synchronous": {"blocked_s": 4.0, "published_s": 4.0},
            "background, page-locked buffers reused": {"blocked_s": 0.2, "published_s": 4.5},
        },
    }
    (tmp_path / "async_save.json").write_text(json.dumps(saves))
    write_junit(tmp_path / "junit-gpu_tests.xml", tests=9, failures=1, skipped=2)
    results = [gpu_run.StepResult("gpu_tests", 60, "failed (1)", 41.0, "logs/4-gpu_tests.log")]
    markdown = gpu_run.summarize(tmp_path, results)
    assert markdown.startswith("# GPU run: NVIDIA H100 80GB HBM3\n")
    assert "| gpu_tests | 60 | 41 | failed (1) | 6 passed, 1 failed, 2 skipped |" in markdown
    assert "| finetune_full | 40,000 | 42.0% | 30,000 | 31,000 |" in markdown
    assert "| checkpoint save, 1.35 GB | step blocked s | published after s |" in markdown
    assert "| background, page-locked buffers reused | 0.20 | 4.50 |" in markdown
    met = {
        row["target"]: row["met"] for row in json.loads((tmp_path / "results.json").read_text())["targets"]
    }
    assert met == {
        "finetune_full / transformers loop tokens/s": True,
        "finetune_full MFU (executed FLOPs)": True,
        "finetune_lora / finetune_full tokens/s": False,
        "full peak - LoRA peak (MiB)": True,
        "litsft plan / measured peak, finetune_full": True,
        "litsft plan / measured peak, finetune_lora": False,
        "float8 loss vs bf16 (largest relative difference)": True,
        "float8 / bf16 tokens/s": None,
    }
    # The context-parallel runs: a table of tokens/s per GPU, the skipped size, the anchor, and the plan judged.
    context = {
        "runs": {"context_1": {"devices": 1, "context": 1, "tokens_per_second_per_gpu": 9000.0, "mfu": 0.41,
                               "peak_mib": 40000.0, "planned_peak_mib": 42000.0}},
        "skipped": {"context_2": "--parallel.context 2 needs 2 GPUs of one node; found 1"},
        "anchor": {"source": "https://example.org/table", "setup": "Llama 3.1 8B, 8x H100",
                   "tokens_per_second_per_gpu": {"131072 tokens, CP 4": 1071}},
    }  # fmt: skip
    (tmp_path / "context_parallel.json").write_text(json.dumps(context))
    markdown = gpu_run.summarize(tmp_path, [])
    assert "| context_1 | 1 | 9,000 | 41.0% | 40,000 | 42,000 |" in markdown
    assert (
        "| context_2 | — | skipped: --parallel.context 2 needs 2 GPUs of one node; found 1 | | | |"
        in markdown
    )
    assert "131072 tokens, CP 4: 1,071 tokens/s per GPU (https://example.org/table)" in markdown
    assert "| litsft plan / measured peak, context_1 at 32k | 1.05 | 0.90-1.10 | yes |" in markdown
    (tmp_path / "context_parallel.json").unlink()
    moe = {
        "model": "Qwen3-30B-A3B's layers, 2 of 48",
        "runs": {"finetune_full": {"tokens_per_second": 20000.0, "mfu": 0.2, "peak_mib": 30000.0,
                                   "planned_peak_mib": 31000.0}},
    }  # fmt: skip
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    markdown = gpu_run.summarize(tmp_path, [])
    assert "| Qwen3-30B-A3B's layers, 2 of 48 | tokens/s | MFU | peak MiB | plan MiB |" in markdown
    assert "| finetune_full | 20,000 | 20.0% | 30,000 | 31,000 |" in markdown
    # A run cut short: no figures, so nothing is judged met.
    (tmp_path / "bench_gpu.json").unlink()
    assert "| finetune_full MFU (executed FLOPs) | — | >= 40% | — |" in gpu_run.summarize(tmp_path, [])


# ---- prepare_wheels.py ---------------------------------------------------------------------------------------
def tiny_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", size: int = 0) -> Path:
    """A minimal valid wheel of `name` (`size` bytes of stored padding make it that much bigger)."""
    project = name.replace("-", "_")
    path = folder / f"{project}-{version}-{tag}.whl"
    info = f"{project}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
        if size:
            wheel.writestr(f"{project}/padding.bin", bytes(size))
    return path


def pinned() -> list[tuple[str, str]]:
    return [tuple(requirement.split("==")) for requirement in prepare_wheels.WHEELS]


def test_the_wheels_are_downloaded_for_python_3_12_and_the_folder_to_carry_is_named(tmp_path, capsys) -> None:
    links, dest = tmp_path / "links", tmp_path / "dest"
    links.mkdir()
    for name, version in pinned():
        if name == "torchao":  # a binary wheel: the CPython 3.12 build must be the one taken
            tiny_wheel(links, name, version, "cp311-cp311-manylinux_2_28_x86_64")
            tiny_wheel(links, name, version, "cp312-cp312-manylinux_2_28_x86_64")
        else:
            tiny_wheel(links, name, version)
    tiny_wheel(links, "torch", "2.11.0", "cp312-cp312-manylinux_2_28_x86_64")  # never asked for
    prepare_wheels.main(["--dest", str(dest), "--find-links", str(links)])
    names = sorted(path.name for path in dest.glob("*.whl"))
    assert len(names) == len(prepare_wheels.WHEELS)
    assert "torchao-0.17.0-cp312-cp312-manylinux_2_28_x86_64.whl" in names
    assert not any(name.startswith("torch-") for name in names)
    out = capsys.readouterr().out
    assert out.startswith(
        f"{len(names)} wheels, 0.0 MiB (limit 48 of 64 MiB): carry {dest} with the checkout"
    )


def test_the_pins_hold_what_the_image_lacks_and_never_torch() -> None:
    names = {name.lower().replace("_", "-") for name, _ in pinned()}
    assert {"jsonargparse", "docstring-parser", "typeshed-client", "litdata", "boto3", "botocore", "s3transfer",
            "jmespath", "obstore", "datasets", "dill", "multiprocess", "torchao", "pytest"} <= names  # fmt: skip
    assert not names & {"torch", "triton", "lightning", "transformers"}
    assert ("torchao", "0.17.0") in pinned()  # the release made for torch 2.11 (see the comment in WHEELS)
    command = prepare_wheels.download_command(Path("d"))
    assert command[command.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in command
    assert "--no-deps" in command and "manylinux2014_x86_64" in command and "--no-index" not in command


def test_wheels_that_do_not_fit_or_do_not_belong_are_refused_in_one_line(tmp_path: Path) -> None:
    for name, version in pinned():
        tiny_wheel(tmp_path, name, version, size=200_000 if name == "botocore" else 0)
    assert 0.19 < prepare_wheels.check_wheels(tmp_path) < 0.25
    with pytest.raises(
        SystemExit, match=r"^error: the wheels in .* take 0\.2 MiB, over the 0\.1 MiB kept for them"
    ):
        prepare_wheels.check_wheels(tmp_path, limit_mib=0.1)
    torch_wheel = tiny_wheel(tmp_path, "torch", "2.11.0", "cp312-cp312-manylinux_2_28_x86_64")
    with pytest.raises(SystemExit, match=r"holds torch: the image's own torch must be used; delete them$"):
        prepare_wheels.check_wheels(tmp_path)
    torch_wheel.unlink()
    tiny_wheel(tmp_path, "flask", "2.0.0")
    with pytest.raises(SystemExit, match=r"holds wheels not in the list \(flask\)"):
        prepare_wheels.check_wheels(tmp_path)
    for path in tmp_path.glob("flask-*"):
        path.unlink()
    next(tmp_path.glob("datasets-*")).unlink()
    with pytest.raises(SystemExit, match=r"lacks wheels for datasets; run this script again$"):
        prepare_wheels.check_wheels(tmp_path)


def test_the_install_check_requires_the_image_torch_and_what_the_steps_import(monkeypatch, capsys) -> None:
    check_install = load("benchmarks/gpu/check_install.py", "check_install")
    modules = {
        name: types.SimpleNamespace(__file__=f"/image/{name}/__init__.py", LlamaForCausalLM=object)
        for name, _, _ in (entry.partition(":") for entry in check_install.REQUIRED)
    }

    def import_module(name: str):
        if name not in modules:
            raise ModuleNotFoundError(f"No module named '{name}'")
        return modules[name]

    monkeypatch.setattr(check_install.importlib, "import_module", import_module)
    assert check_install.main("/site") == 0  # litdata and datasets missing: reported only
    assert (
        "litdata: does not import: ModuleNotFoundError: No module named 'litdata'" in capsys.readouterr().out
    )
    modules["torch"] = types.SimpleNamespace(__file__="/site/torch/__init__.py")
    assert check_install.main("/site") == 1
    assert "torch comes from the carried wheels" in capsys.readouterr().out
    modules["torch"] = types.SimpleNamespace(__file__="/image/torch/__init__.py")

    class TransformersWithoutUrllib3:  # its model classes import accelerate, which imports the carried boto3
        __file__ = "/image/transformers/__init__.py"

        def __getattr__(self, name: str):
            raise ModuleNotFoundError("No module named 'urllib3'")

    modules["transformers"] = TransformersWithoutUrllib3()
    assert check_install.main("/site") == 1
    assert (
        "transformers: does not import: ModuleNotFoundError: No module named 'urllib3'"
        in capsys.readouterr().out
    )
    modules["transformers"] = types.SimpleNamespace(
        __file__="/image/transformers/__init__.py", LlamaForCausalLM=object
    )
    assert check_install.main("/site") == 0
    del modules["torchao"]
    assert check_install.main("/site") == 1
