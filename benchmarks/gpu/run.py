"""The whole GPU check in one command: install, tests, benchmarks, plan against measured, the demo; each step
under its own time limit, logs and results under one folder, a summary table printed last.

bash benchmarks/gpu/run.sh [--dry-run] [--only STEP,STEP...] [OUT_DIR]      (OUT_DIR: default $OUT)

Made for a lent GPU machine whose image has torch but not every package litsft needs, and no network: the
missing wheels travel with the checkout in .whl/ (benchmarks/gpu/prepare_wheels.py makes it, on a machine
with network) and are installed with litsft into WORK_DIR/site against the image's own torch. WORK_DIR
($TMPDIR/litsft-gpu-run, made afresh) holds what is large (the packages, the benchmark's 5 GB checkpoint, the
runs): OUT_DIR is carried back and gets the logs and results only. Every step runs in
its own process group, killed when its budget runs out; the budgets add up to at most TOTAL_BUDGET_S, so the
whole run ends within it whatever happens. A failed or timed-out step is recorded and the next one runs (only a
failed install stops the run: everything else needs it). This file uses the standard library only: it runs
before anything is installed.

OUT_DIR/logs/<n>-<step>.log      each step's output
OUT_DIR/bench_gpu.json           benchmarks/bench_gpu.py's figures (rewritten after each of its runs)
OUT_DIR/async_save.json          benchmarks/bench_async_save.py's figures (the time a save blocks a step)
OUT_DIR/context_parallel.json    bench_gpu.py --context_sizes 1 2: tokens/s per GPU at 32k tokens by context size
OUT_DIR/moe.json                 bench_gpu.py --moe_layers 2: a cut-down Qwen3-30B-A3B, litsft and transformers

Without --only, every step runs but the optional ones (moe: it does not fit the eight minutes beside the others);
--only runs the named steps, in the order above (install always first: everything else needs it).
OUT_DIR/results.json, results.md every step's status and time, test counts, figures and targets
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 480
"""Eight minutes: a GPU call may run ten, and this leaves time to start the machine and carry the results."""
CPU_SUBSET = (
    "tests/test_model_network_transformer.py", "tests/test_model_network_loss.py", "tests/test_training_optimizer.py",
    "tests/test_training_metrics.py", "tests/test_model_accounting_flops.py",
)  # fmt: skip
"""Test files that pass on the CPU, run again where torch sees a GPU: what picks its device itself goes to CUDA."""


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    command: str
    """A bash command, run in WORK_DIR/work with the installed packages on PYTHONPATH."""
    what: str
    optional: bool = False
    """Run only when --only names it."""


WORK_DIR = Path(tempfile.gettempdir()) / "litsft-gpu-run"


def steps(out_dir: Path, work_dir: Path = WORK_DIR, python: str = "python3") -> list[Step]:
    """The steps of a run writing its results under `out_dir` and everything else under `work_dir`, in order."""
    site, wheels, repo, out, work = (
        shlex.quote(str(p)) for p in (work_dir / "site", REPO / ".whl", REPO, out_dir, work_dir / "work")
    )
    pytest = f"{python} -m pytest -q -p no:cacheprovider --rootdir {repo}"
    return [
        Step(
            "install", 45,
            f"test -n \"$(ls {wheels}/*.whl 2>/dev/null)\" || {{ echo 'no wheels in {wheels}: run "
            f"benchmarks/gpu/prepare_wheels.py and carry .whl'; exit 1; }}; "
            # setuptools, wheel and packaging only build litsft's wheel (in pip's isolated build environment):
            # installed next to the image's packages they would shadow its own.
            f"ls {wheels}/*.whl | grep -v -E '/(setuptools|wheel|packaging)-' | xargs {python} -m pip install -q "
            f"--no-index --no-deps --no-compile --target {site} && "
            f"{python} -m pip install -q --no-index --find-links {wheels} --no-deps --no-compile --target {site} {repo} && "
            f"{python} {repo}/benchmarks/gpu/check_install.py {site}",
            "the carried wheels and litsft from the checkout, into WORK_DIR/site, against the image's torch",
        ),
        Step(
            "environment", 10,
            f"nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; {python} -c \"import torch; "
            "print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), "
            "torch.cuda.get_device_capability())\"",
            "the GPU, the driver, torch and CUDA versions",
        ),
        Step(
            "torch_api", 15,
            f"{pytest} --junitxml {out}/junit-torch_api.xml {repo}/tests/test_torch_compatibility.py",
            "the torch and torchao functions litsft calls take its arguments (the image's versions)",
        ),
        Step(
            "gpu_tests", 65,
            f"{pytest} -m gpu --junitxml {out}/junit-gpu_tests.xml {repo}/tests",
            "the tests a CPU machine skips (pytest -m gpu): flash, flex, float8, grouped_mm, generation, syncs",
        ),
        Step(
            "cpu_subset_on_cuda", 35,
            f"{pytest} --junitxml {out}/junit-cpu_subset_on_cuda.xml "
            + " ".join(f"{repo}/{path}" for path in CPU_SUBSET),
            "test files that pass on the CPU, on the GPU machine",
        ),
        Step(
            "bench_gpu", 205,
            f"{python} {repo}/benchmarks/bench_gpu.py --steps 30 --warmup 10 --max_seq_length 4096 --records 2000 "
            f"--float8 tensorwise --results_json {out}/bench_gpu.json --work_dir {work}/bench",
            "finetune_full, the compiled transformers loop, finetune_lora, finetune_full float8; plan vs peak",
        ),
        Step(
            "context_parallel", 35,
            f"{python} {repo}/benchmarks/bench_gpu.py --context_sizes 1 2 --max_seq_length 32768 --steps 10 "
            f"--warmup 3 --records 1000 --results_json {out}/context_parallel.json --work_dir {work}/context",
            "finetune_full at 32k tokens with --parallel.context 1 and 2 on two GPUs (context 2 skipped on one): "
            "tokens/s per GPU, read against torchtitan's published Llama 3.1 8B table",
        ),
        Step(
            "moe", 300,
            f"{python} {repo}/benchmarks/bench_gpu.py --moe_layers 2 --steps 16 --warmup 6 --max_seq_length 4096 "
            f"--records 1000 --results_json {out}/moe.json --work_dir {work}/moe",
            "a mixture of experts (Qwen3-30B-A3B's layers, 2 of 48) on one GPU: finetune_full and the transformers "
            "loop, tokens/s, MFU, peak against the plan",
            optional=True,
        ),
        Step(
            "async_save", 35,
            f"{python} {repo}/benchmarks/bench_async_save.py --device cuda --repeats 2 "
            f"--results_json {out}/async_save.json --work_dir {work}/async_save",
            "a step blocked by a checkpoint save: synchronous, in the background into ordinary or page-locked memory",
        ),
        Step(
            "demo", 35,
            f"{python} -m litsft demo --devices 1 --max_steps 60 --num_eval 20 --out_dir {work}/demo",
            "a shortened `litsft demo --devices 1` (60 steps, 20 held-out prompts)",
        ),
    ]  # fmt: skip


@dataclass
class StepResult:
    name: str
    budget_s: int
    status: str
    """passed, failed (exit status), timed out, or not run."""
    seconds: float
    log: str


def run_step(step: Step, index: int, out_dir: Path, env: dict[str, str], cwd: Path) -> StepResult:
    """Run `step` in `cwd`, in its own process group, its output into its log under `out_dir`; kill the group
    when the budget ends."""
    log = out_dir / "logs" / f"{index}-{step.name}.log"
    started = time.monotonic()
    with open(log, "w") as output:
        output.write(f"$ {step.command}\n")
        output.flush()
        process = subprocess.Popen(
            ["bash", "-c", step.command], stdout=output, stderr=subprocess.STDOUT, env=env,
            cwd=cwd, start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=step.budget_s)
            status = "passed" if code == 0 else f"failed ({code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timed out"
    return StepResult(
        step.name, step.budget_s, status, time.monotonic() - started, str(log.relative_to(out_dir))
    )


def test_counts(junit: Path) -> dict[str, int] | None:
    """passed / failed / skipped counts of a pytest --junitxml file, None if there is none."""
    if not junit.is_file():
        return None
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def targets(bench: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, wanted, met) for each of the run's targets that bench_gpu.py's figures decide."""
    runs = bench.get("runs", {})
    full = runs.get("finetune_full", {})
    lora = next((run for name, run in runs.items() if name.startswith("finetune_lora")), {})
    float8 = next((run for name, run in runs.items() if name.startswith("finetune_full_float8")), None)
    rows: list[tuple[str, str, str, bool | None]] = []

    def add(name: str, value: float | None, wanted: str, met: bool | None, form: str = "{:.2f}") -> None:
        rows.append(
            (name, "—" if value is None else form.format(value), wanted, None if value is None else met)
        )

    ratio = bench.get("full_over_transformers_loop")
    add("finetune_full / transformers loop tokens/s", ratio, ">= 1.2x", ratio is not None and ratio >= 1.2)
    mfu = full.get("mfu")
    add("finetune_full MFU (executed FLOPs)", mfu, ">= 40%", mfu is not None and mfu >= 0.4, "{:.1%}")
    ratio = bench.get("lora_over_full")
    add("finetune_lora / finetune_full tokens/s", ratio, ">= 1.5x", ratio is not None and ratio >= 1.5)
    saved, base = bench.get("full_minus_lora_peak_mib"), bench.get("fp32_base_copy_mib")
    add("full peak - LoRA peak (MiB)", saved, f">= {base:,.0f} (fp32 base)" if base else "fp32 base",
        saved is not None and base is not None and saved >= base, "{:,.0f}")  # fmt: skip
    for name, run in (("finetune_full", full), ("finetune_lora", lora)):
        ratio = run.get("plan_over_measured")
        add(
            f"litsft plan / measured peak, {name}",
            ratio,
            "0.90-1.10",
            ratio is not None and abs(ratio - 1) <= 0.1,
        )
    if float8 is not None or "float8_over_full" in bench:
        difference = bench.get("float8_loss_max_relative_difference")
        add("float8 loss vs bf16 (largest relative difference)", difference, "<= 1%",
            difference is not None and difference <= 0.01, "{:.2%}")  # fmt: skip
        add("float8 / bf16 tokens/s", bench.get("float8_over_full"), "(reported)", None)
    return rows


def context_lines(context: dict) -> list[str]:
    """The context-parallel runs' table (bench_gpu.py --context_sizes), the sizes skipped, and the anchor."""
    if not context:
        return []
    lines = [
        "",
        "| 32k tokens | GPUs | tokens/s per GPU | MFU | peak MiB | plan MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in context.get("runs", {}).items():
        mfu = "—" if run.get("mfu") is None else f"{run['mfu']:.1%}"
        lines.append(
            f"| {name} | {run['devices']} | {run['tokens_per_second_per_gpu']:,.0f} | {mfu} | {run['peak_mib']:,.0f} "
            f"| {run['planned_peak_mib']:,.0f} |"
        )
    for name, reason in context.get("skipped", {}).items():
        lines.append(f"| {name} | — | skipped: {reason} | | | |")
    anchor = context.get("anchor")
    if anchor:
        figures = ", ".join(f"{k}: {v:,}" for k, v in anchor["tokens_per_second_per_gpu"].items())
        lines += [
            "",
            f"Anchor (another model and GPU): torchtitan, {anchor['setup']}: {figures} tokens/s per GPU ({anchor['source']}).",
        ]
    return lines


def context_targets(context: dict) -> list[tuple[str, str, str, bool | None]]:
    """The plan against each context-parallel run's peak, as the other runs' (within 10%)."""
    rows: list[tuple[str, str, str, bool | None]] = []
    for name, run in context.get("runs", {}).items():
        ratio = run["planned_peak_mib"] / run["peak_mib"]
        rows.append(
            (
                f"litsft plan / measured peak, {name} at 32k",
                f"{ratio:.2f}",
                "0.90-1.10",
                abs(ratio - 1) <= 0.1,
            )
        )
    return rows


def summarize(out_dir: Path, results: list[StepResult]) -> str:
    """Write results.json and results.md under `out_dir`; return the markdown."""
    bench_file = out_dir / "bench_gpu.json"
    bench = json.loads(bench_file.read_text()) if bench_file.is_file() else {}
    tests = {
        name: test_counts(out_dir / f"junit-{name}.xml")
        for name in ("torch_api", "gpu_tests", "cpu_subset_on_cuda")
    }
    lines = [f"# GPU run: {bench.get('device', 'device unknown')}", "", "| step | budget s | seconds | status | tests |",
             "|---|---:|---:|---|---|"]  # fmt: skip
    for result in results:
        counts = tests.get(result.name)
        described = ", ".join(f"{n} {k}" for k, n in counts.items()) if counts else ""
        lines.append(
            f"| {result.name} | {result.budget_s} | {result.seconds:.0f} | {result.status} | {described} |"
        )
    runs = bench.get("runs", {})
    if runs:
        lines += ["", "| run | tokens/s | MFU | peak MiB | plan MiB |", "|---|---:|---:|---:|---:|"]
        for name, run in runs.items():
            plan = f"{run['planned_peak_mib']:,.0f}" if "planned_peak_mib" in run else ""
            lines.append(
                f"| {name} | {run['tokens_per_second']:,.0f} | {run['mfu']:.1%} | {run['peak_mib']:,.0f} | {plan} |"
            )
    moe_file = out_dir / "moe.json"
    moe = json.loads(moe_file.read_text()) if moe_file.is_file() else {}
    if moe.get("runs"):
        lines += [
            "",
            f"| {moe['model']} | tokens/s | MFU | peak MiB | plan MiB |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, run in moe["runs"].items():
            plan = f"{run['planned_peak_mib']:,.0f}" if "planned_peak_mib" in run else ""
            lines.append(
                f"| {name} | {run['tokens_per_second']:,.0f} | {run['mfu']:.1%} | {run['peak_mib']:,.0f} | {plan} |"
            )
    context_file = out_dir / "context_parallel.json"
    context = json.loads(context_file.read_text()) if context_file.is_file() else {}
    lines += context_lines(context)
    saves_file = out_dir / "async_save.json"
    saves = json.loads(saves_file.read_text()) if saves_file.is_file() else {}
    if saves:
        lines += ["", f"| checkpoint save, {saves['checkpoint_gb']:.2f} GB | step blocked s | published after s |",
                  "|---|---:|---:|"]  # fmt: skip
        for kind, save in saves["saves"].items():
            lines.append(f"| {kind} | {save['blocked_s']:.2f} | {save['published_s']:.2f} |")
    rows = targets(bench) + context_targets(context)
    lines += ["", "| target | measured | wanted | met |", "|---|---:|---|---|"]
    for name, value, wanted, met in rows:
        lines.append(f"| {name} | {value} | {wanted} | {'—' if met is None else 'yes' if met else 'NO'} |")
    markdown = "\n".join(lines) + "\n"
    (out_dir / "results.md").write_text(markdown)
    summary = {
        "steps": [asdict(result) for result in results],
        "tests": tests,
        "bench_gpu": bench,
        "context_parallel": context,
        "moe": moe,
        "async_save": saves,
        "targets": [dict(zip(("target", "measured", "wanted", "met"), row)) for row in rows],
    }
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    return markdown


def dry_run(plan: list[Step]) -> str:
    lines = [f"{'step':<20}{'budget s':>9}  what"]
    lines += [f"{step.name:<20}{step.budget_s:>9}  {step.what}\n{'':<31}$ {step.command}" for step in plan]
    lines.append(f"{'total':<20}{sum(step.budget_s for step in plan):>9}  (at most {TOTAL_BUDGET_S} s)")
    return "\n".join(lines)


USAGE = "usage: bash benchmarks/gpu/run.sh [--dry-run] [--only STEP,STEP...] [OUT_DIR]"


def selected(plan: list[Step], only: str | None) -> list[Step]:
    """The default steps, or install and those `only` names (comma-separated), in the plan's order."""
    if only is None:
        return [step for step in plan if not step.optional]
    names = set(only.split(","))
    unknown = names - {step.name for step in plan}
    if unknown:
        raise SystemExit(
            f"error: --only names no step {', '.join(sorted(unknown))}; the steps are "
            + ", ".join(step.name for step in plan)
        )
    return [step for step in plan if step.name in names or step.name == "install"]


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    rest = [arg for arg in argv if arg != "--dry-run"]
    only = None
    if "--only" in rest:
        at = rest.index("--only")
        if at + 1 == len(rest):
            print(USAGE, file=sys.stderr)
            return 2
        only = rest[at + 1]
        del rest[at : at + 2]
    if len(rest) > 1 or any(arg.startswith("-") for arg in rest):
        print(USAGE, file=sys.stderr)
        return 2
    target = rest[0] if rest else os.environ.get("OUT")
    if not target:
        print("error: no OUT_DIR given and $OUT is not set; pass the folder to write into", file=sys.stderr)
        return 2
    out_dir = Path(target).resolve()
    plan = selected(steps(out_dir, WORK_DIR, sys.executable), only)
    if sum(step.budget_s for step in plan) > TOTAL_BUDGET_S:
        raise SystemExit(f"error: the steps' budgets add up to more than {TOTAL_BUDGET_S} s")
    if dry:
        print(dry_run(plan))
        return 0
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK_DIR, ignore_errors=True)  # an earlier run's packages and checkpoints
    (WORK_DIR / "work").mkdir(parents=True)
    paths = [str(WORK_DIR / "site"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths),
           "LITSFT_CACHE_DIR": str(WORK_DIR / "work" / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    results = []
    for index, step in enumerate(plan, start=1):
        if results and results[0].status != "passed":
            results.append(StepResult(step.name, step.budget_s, "not run", 0.0, ""))
            continue
        print(f"[{index}/{len(plan)}] {step.name} (at most {step.budget_s} s): {step.what}", flush=True)
        results.append(run_step(step, index, out_dir, env, WORK_DIR / "work"))
        print(f"    {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
    print(summarize(out_dir, results), flush=True)
    return 0 if all(result.status == "passed" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
