"""The README and the tutorials work as written: every command in their ```bash blocks runs here, or says why not.

Each doc's commands run in order, in one bash session, in a fresh directory of tiny stand-ins: every
`checkpoints/<org>/<name>` a command names holds a tiny litsft checkpoint of the same family, every
`hf/<org>/<name>` a tiny Hugging Face checkpoint, `checkpoints/demo` the demo model, `data/*.json(l)` a few
records, and every hub id that `litsft download` names is a tiny model of the same family on a local
stand-in for the Hugging Face Hub (tests/hub_server.py), which also serves every hub dataset a `--data HFDataset`
command names as a small Infinity-Instruct-shaped dataset (tests/tiny_datasets.py). Training commands get SHORT_RUN appended (later
options win in jsonargparse). A command that cannot run here carries a marker comment (MARKERS) at the end
of its line or on the comment line above it.
The ```python blocks run too, in the same directory, in document order.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import launch
import pytest
import yaml
from hub_server import LocalHub
from launch import max_difference, write_tiny_checkpoint
from tiny_datasets import sharegpt_rows, write_infinity_instruct
from tiny_hf import save_tiny_hf, tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TUTORIALS = sorted((ROOT / "tutorials").glob("*.md"))
VENV_BIN = Path(sys.executable).parent
MARKERS = ("# needs GPUs", "# not run by the tests:")
TRAINING = re.compile(r"(?:\blitsft|-m litsft) (finetune_full|finetune_lora|pretrain)\b")


def short_run(world_size: int = 1, max_steps: bool = True) -> list[str]:
    """Appended to every training command: 2 steps of 2 rows x 128 tokens per process, no sample generation,
    on the CPU (so `--devices 2` runs on a machine with one GPU too)."""
    args = [
        "--accelerator", "cpu", "--train.max_seq_length", "128", "--train.micro_batch_size", "2",
        "--train.global_batch_size", str(2 * world_size), "--eval.max_batches", "1", "--eval.max_new_tokens", "0",
    ]  # fmt: skip
    return args + (["--train.max_steps", "2"] if max_steps else [])


DATA_SHORT_RUN = {
    "Demo": ["--data.num_train", "200", "--data.num_val", "8", "--data.num_eval", "4"],
    "TextFiles": ["--data.tokenize_workers", "1"],
}


@dataclass
class Block:
    language: str
    commands: list[Command]


@dataclass
class Command:
    text: str
    """The command on one line (continuation lines joined)."""
    marker: str | None
    """The marker comment that exempts it from running, if any."""


def read_blocks(path: Path) -> list[Block]:
    blocks = []
    for language, body in re.findall(r"```(bash|python)\n(.*?)```", path.read_text(), re.S):
        if language == "python":
            blocks.append(Block("python", [Command(body, None)]))
            continue
        commands, above = [], None
        for line in body.replace("\\\n", " ").splitlines():
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith("#"):
                above = stripped
                continue
            own = next((stripped[stripped.index(m) :] for m in MARKERS if m in stripped), None)
            marker = own or (above if above and above.startswith(MARKERS) else None)
            commands.append(Command(re.sub(r"\s+", " ", stripped), marker))
            above = None
        blocks.append(Block("bash", commands))
    return blocks


def commands(path: Path) -> list[Command]:
    return [c for b in read_blocks(path) if b.language == "bash" for c in b.commands]


def strip_comment(command: str) -> str:
    return re.sub(r"\s+#\s.*$", "", command)


def runnable(command: str, world_size: int | None = None) -> str:
    """The command as the test runs it: training shortened, everything else as written. The world size is
    the command's --devices x --num_nodes unless given."""
    command = strip_comment(command)
    if not TRAINING.search(command):
        return command
    if world_size is None:
        sizes = [re.search(rf"--{name} (\d+)", command) for name in ("devices", "num_nodes")]
        world_size = math.prod(int(size.group(1)) for size in sizes if size)
    background = command.endswith("&")
    extra = short_run(world_size, max_steps=not background)  # a backgrounded run is meant to be interrupted
    for name, args in DATA_SHORT_RUN.items():
        if f"--data {name}" in command:
            extra += args
    # Appended as text: the command's own quoting and $VARIABLES stay as the doc has them.
    return f"{command.rstrip('&').rstrip()} {shlex.join(extra)}" + (" &" if background else "")


def tutorial_commands() -> set[str]:
    return {c.text for path in TUTORIALS for c in commands(path) if c.marker is None}


def to_run(path: Path) -> list[Block]:
    """The blocks of a doc with only the commands the test runs. README commands that a tutorial holds
    word for word run with that tutorial."""
    blocks = []
    for block in read_blocks(path):
        kept = [c for c in block.commands if c.marker is None]
        if path == README:
            kept = [c for c in kept if c.text not in tutorial_commands()]
        if kept:
            blocks.append(Block(block.language, kept))
    return blocks


# ---- stand-ins ---------------------------------------------------------------------------------------------
def family_overrides(name: str) -> dict:
    if "olmoe" in name.lower():
        return dict(
            launch.TINY_MOE,
            hf_architecture="OlmoeForCausalLM",
            expert_intermediate_size=0,
            qk_norm_over="all_heads",
        )
    if "a3b" in name.lower() or "a22b" in name.lower():
        return dict(launch.TINY_MOE)
    if "mixtral" in name.lower():
        return dict(
            launch.TINY_MOE, hf_architecture="MixtralForCausalLM", expert_intermediate_size=0, qk_norm=False
        )
    if "qwen3" in name.lower():
        return dict(qk_norm=True, head_dim=32, hf_architecture="Qwen3ForCausalLM")
    if "qwen2" in name.lower():
        return dict(qkv_bias=True, tie_word_embeddings=True, hf_architecture="Qwen2ForCausalLM")
    if "mistral" in name.lower():
        return dict(hf_architecture="MistralForCausalLM")
    return {}


def hf_kind(name: str) -> str:
    lower = name.lower()
    moe = {"olmoe": "olmoe", "a3b": "qwen3-moe", "a22b": "qwen3-moe", "mixtral": "mixtral"}
    for word, kind in moe.items():
        if word in lower:
            return kind
    return (
        "qwen3"
        if "qwen3" in lower
        else "qwen2"
        if "qwen2" in lower
        else "mistral"
        if "mistral" in lower
        else "llama"
    )


def referenced_paths(blocks: list[Block]) -> set[str]:
    """checkpoints/<org>/<name> and hf/<org>/<name> paths the commands (and the configs they load) name."""
    text = " ".join(c.text for b in blocks if b.language == "bash" for c in b.commands)
    for config in re.findall(r"--config (\S+\.yaml)", text):
        text += " " + str(yaml.safe_load((ROOT / config).read_text()).get("checkpoint_dir", ""))
    return set(re.findall(r"\b(?:checkpoints|hf)/[\w.-]+/[\w.-]+", text))


def write_records(path: Path, conversations: bool) -> None:
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    records = []
    for _ in range(64):
        # Short: the tiny tokenizer spends a token per character or two, and rows are 128 tokens.
        prompt, answer = " ".join(rng.choices(words, k=3)), " ".join(rng.choices(words, k=2))
        if conversations:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            records.append({"messages": messages})
        else:
            records.append({"instruction": prompt, "output": answer})
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from litsft.cli.demo import make_base_checkpoint

    return make_base_checkpoint(tmp_path_factory.mktemp("demo") / "demo", seed=0)


def make_workspace(root: Path, blocks: list[Block], demo_checkpoint: Path) -> Path:
    import shutil

    workspace = root / "workspace"
    (workspace / "data").mkdir(parents=True)
    shutil.copytree(demo_checkpoint, workspace / "checkpoints" / "demo")
    (workspace / "config_hub").symlink_to(ROOT / "config_hub")
    for name in ("alpaca.json", "instructions.json"):
        write_records(workspace / "data" / name, conversations=False)
    write_records(workspace / "data" / "conversations.jsonl", conversations=True)
    (workspace / "data" / "sharegpt.json").write_text(json.dumps(sharegpt_rows(64)))
    text = " ".join(c.text for b in blocks for c in b.commands)
    converted = set(re.findall(r"convert_from_hf \S+ --out_dir (\S+)", text))
    converted |= {f"checkpoints/{repo_id}" for repo_id in downloaded_repos(blocks)}
    for path in referenced_paths(blocks) - converted:
        if path.startswith("hf/"):
            save_tiny_hf(tiny_hf_model(hf_kind(path)), workspace / path)
        else:
            write_tiny_checkpoint(workspace / path, **family_overrides(path))
    return workspace


def downloaded_repos(blocks: list[Block]) -> list[str]:
    """The hub ids a doc's commands download."""
    text = " ".join(c.text for b in blocks if b.language == "bash" for c in b.commands)
    return sorted(set(re.findall(r"\blitsft download ([\w.-]+/[\w.-]+)", text)))


def hub_datasets(blocks: list[Block]) -> list[str]:
    """The hub dataset ids that a doc's `--data HFDataset` commands (and the configs they load) name."""
    ids = set()
    for command in (c.text for b in blocks if b.language == "bash" for c in b.commands):
        for config in re.findall(r"--config (\S+\.yaml)", command):
            data = yaml.safe_load((ROOT / config).read_text()).get("data") or {}
            if str(data.get("class_path", "")).endswith("HFDataset"):
                ids.add(data["init_args"]["path"])
        if "--data HFDataset" in command:
            ids.update(re.findall(r"--data\.path ([A-Za-z0-9][\w.-]*/[\w.-]+)(?:\s|$)", command))
    return sorted(i for i in ids if not i.startswith("data/"))


@contextmanager
def local_hub(blocks: list[Block], root: Path) -> Iterator[dict[str, str]]:
    """A local stand-in for the Hugging Face Hub serving a tiny model of the right family under each hub id
    the doc downloads, and a small ShareGPT dataset under each hub dataset id it names; yields the environment
    that points huggingface_hub and `datasets` at it."""
    with LocalHub() as hub:
        for repo_id in downloaded_repos(blocks):
            hub.add_repo(repo_id, save_tiny_hf(tiny_hf_model(hf_kind(repo_id)), root / "hub" / repo_id))
        for repo_id in hub_datasets(blocks):
            hub.add_dataset(
                repo_id, write_infinity_instruct(root / "hub-datasets" / repo_id, sharegpt_rows(64))
            )
        yield {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(root / "hf-home"),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_TOKEN": "",
        }


def run_doc(path: Path, tmp_path: Path, demo_checkpoint: Path) -> str:
    """Run the doc's commands in order in one bash session; return the output. Fails at the first failure."""
    blocks = to_run(path)
    workspace = make_workspace(tmp_path, blocks, demo_checkpoint)
    with local_hub(blocks, tmp_path) as hub_env:
        return _run_script(path, blocks, workspace, tmp_path, hub_env)


def _run_script(path: Path, blocks: list[Block], workspace: Path, tmp_path: Path, env: dict[str, str]) -> str:
    lines = [f'export PATH={shlex.quote(str(VENV_BIN))}:"$PATH"']
    for block in blocks:
        if block.language == "python":
            commands_run = [f"python - <<'PYTHON'\n{block.commands[0].text}PYTHON"]
        else:
            commands_run = [runnable(c.text) for c in block.commands]
        for command in commands_run:
            lines += [
                command,
                f'[ "$?" -eq 0 ] || {{ echo "FAILED: "{shlex.quote(command[:200])}; exit 1; }}',
            ]
    script = "\n".join(lines) + "\n"
    (tmp_path / "commands.sh").write_text(script)
    result = subprocess.run(
        ["bash", str(tmp_path / "commands.sh")],
        cwd=workspace,
        env={**launch.test_env(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=launch.DEADLINE_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{path.name}:\n{script}\n{output[-8000:]}"
    return output


# ---- the tests ---------------------------------------------------------------------------------------------
DOCS_TO_RUN = [p for p in [README, *TUTORIALS] if to_run(p)]


@pytest.mark.parametrize("path", DOCS_TO_RUN, ids=lambda p: p.name)
def test_doc_commands_run(path: Path, tmp_path: Path, demo_checkpoint: Path) -> None:
    output = run_doc(path, tmp_path, demo_checkpoint)
    # Outputs a doc quotes after a command (the planner's verdicts) are what the command prints.
    for quoted in re.findall(r"^# ((?:fits|does not fit): .*)$", path.read_text(), re.M):
        assert quoted in output
    if path.name == "resume.md":
        stopped = re.search(r"Stopped by a signal after step (\d+)", output)
        assert stopped and "exit code 124" in output, output[-4000:]
        assert f"at step {stopped.group(1)}" in output  # the relaunch resumed where the signal stopped it


def test_every_command_is_run_or_marked() -> None:
    """Unmarked commands are the ones test_doc_commands_run runs; none of them may need more than the 2
    processes this machine can run, and every marker says why."""
    from litsft.runtime.preemption import PREEMPTED_EXIT_CODE

    assert PREEMPTED_EXIT_CODE == 124  # the exit code the docs and multi_node.slurm rely on
    all_commands = [(p, c) for p in [README, *TUTORIALS] for c in commands(p)]
    assert len(all_commands) > 30
    ran = {c.text for p in DOCS_TO_RUN for b in to_run(p) for c in b.commands}
    for path, command in all_commands:
        if command.marker is not None:
            assert re.search(r"(# needs GPUs|# not run by the tests): \S", command.marker), (
                path.name,
                command,
            )
            continue
        assert command.text in ran, (path.name, command.text)
        if command.text.startswith("litsft plan"):
            continue  # plans for devices it does not use
        counts = re.findall(r"--(?:devices|nproc_per_node|num_nodes) (\d+)", command.text)
        config = re.search(r"--config (\S+\.yaml)", command.text)
        if config:
            values = yaml.safe_load((ROOT / config.group(1)).read_text())
            counts += [str(values.get("devices", 1)), str(values.get("num_nodes", 1))]
        assert all(int(n) <= 2 for n in counts), f"{path.name}: mark it '# needs GPUs: ...': {command.text}"


def test_readme_quick_start_is_what_ci_runs() -> None:
    from litsft.__main__ import COMMANDS

    ci_line = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme_commands = [c.text for c in commands(README)]
    assert ci_line in readme_commands
    assert "bash .ci/install.sh && .venv/bin/litsft demo" in readme_commands and "demo" in COMMANDS


# How README names each adapter variant (litsft/model/lora/variants/) and each record shape (SHAPE_FIELDS).
VARIANTS_IN_README = {
    "lora": "LoRA",
    "rslora": "rsLoRA",
    "dora": "DoRA",
    "loraplus": "LoRA+",
    "pissa": "PiSSA",
}
SHAPES_IN_README = {
    "messages": "OpenAI-style `messages`",
    "sharegpt": "ShareGPT `conversations`",
    "alpaca": "Alpaca",
    "prompt_completion": "prompt/completion",
    "preference": "preference pairs",
    "text": "plain `text`",
}


def test_readme_lists_every_registered_family_adapter_variant_and_record_shape() -> None:
    """Adding a family, a variant or a record shape without README saying so fails here: the Supported models
    table has one row per registered architecture, the finetune_lora tutorial's row names every variant, and the
    sentence on record shapes names every shape."""
    from litsft.data.records import SHAPE_FIELDS
    from litsft.model.families import FAMILIES
    from litsft.model.lora.variants import VARIANT_NAMES

    text = README.read_text()
    models = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| `(\w+)` \|", models, flags=re.M)) == sorted(FAMILIES)
    assert set(VARIANTS_IN_README) == set(VARIANT_NAMES)
    (lora_row,) = [line for line in text.splitlines() if line.startswith("| [finetune_lora]")]
    assert [name for name in VARIANTS_IN_README.values() if f" {name}," not in lora_row] == []
    assert set(SHAPES_IN_README) == set(SHAPE_FIELDS)
    shapes = " ".join(text.split("are recognised per record", 1)[0].rsplit("\n\n", 1)[1].split())
    assert [name for name in SHAPES_IN_README.values() if name not in shapes] == []


def test_doc_links_resolve() -> None:
    for path in [README, *TUTORIALS]:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), (path.name, target)


# ---- multi-node launchers on 127.0.0.1 ------------------------------------------------------------------------
def free_port(low: int = 1024, high: int = 65535) -> int:
    for _ in range(100):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


FAKE_SRUN = """#!/bin/bash
# srun on one machine: SLURM_NTASKS tasks with the variables srun gives each task.
pids=()
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  SLURM_PROCID=$rank SLURM_LOCALID=$((rank % SLURM_NTASKS_PER_NODE)) \\
    SLURM_NODEID=$((rank / SLURM_NTASKS_PER_NODE)) "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_torchrun_and_slurm_launch_two_nodes(tmp_path: Path, demo_checkpoint: Path) -> None:
    """The multi-node tutorial's torchrun command on two "nodes" (one process each), and multi_node.slurm's
    srun line with SLURM's per-task variables: both train, and train the same weights."""
    doc = ROOT / "tutorials" / "multi_node.md"
    torchrun = next(c.text for c in commands(doc) if c.text.startswith("torchrun"))
    blocks = [Block("bash", [Command(torchrun, None)])]
    workspace = make_workspace(tmp_path, blocks, demo_checkpoint)
    env = launch.test_env(tmp_path)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"

    # torchrun: the command as written, on 1 process per node instead of 8 GPUs.
    command = runnable(torchrun, world_size=2)
    command = command.replace("--nproc_per_node 8", "--nproc_per_node 1").replace(
        "--devices 8", "--devices 1"
    )
    command = command.replace("--master_port 29500", f"--master_port {free_port()}")
    nodes = [
        subprocess.Popen(
            ["bash", "-c", command],
            cwd=workspace,
            env=dict(env, NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=launch.DEADLINE_S)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-4000:] + outputs[1][-4000:]

    # SLURM: the batch script itself, with srun starting 2 tasks on 2 "nodes" as a 2 x 1 allocation would.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    port = free_port(15000, 24999)  # Lightning's SLURMEnvironment takes the port from the job id
    slurm_env = dict(
        env,
        PATH=f"{bin_dir}:{env['PATH']}",
        SLURM_JOB_ID=f"7{port - 15000:04d}",
        SLURM_JOB_NAME="litsft",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NODELIST="127.0.0.1,127.0.0.2",
    )
    args = torchrun.split("-m litsft ", 1)[1].split(" --devices")[0].split()
    args += ["--fsdp.sharding_strategy", "HYBRID_SHARD", "--out_dir", "out/slurm", *short_run(world_size=2)]
    result = subprocess.run(
        ["bash", str(ROOT / "tutorials" / "multi_node.slurm"), *args],
        cwd=workspace,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=launch.DEADLINE_S,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "HYBRID_SHARD" in torchrun and "--num_nodes 2" in torchrun

    checkpoint = workspace / "checkpoints" / "meta-llama" / "Llama-3.1-8B"
    assert (
        max_difference(workspace / "out" / "multi_node" / "final", workspace / "out" / "slurm" / "final")
        < 1e-6
    )
    assert max_difference(checkpoint, workspace / "out" / "slurm" / "final") > 1e-5  # 2 steps at lr 2e-5


# ---- the sharding-strategy tables ------------------------------------------------------------------------------
def load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "bench_strategies", ROOT / "benchmarks" / "bench_strategies.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sharding_tables_match_the_latest_benchmark() -> None:
    bench = load_benchmark()
    results = json.loads(bench.RESULTS.read_text())
    text = bench.TUTORIAL.read_text()
    assert bench.section(text, "measured") == bench.render_measured(results)
    assert bench.section(text, "planned") == bench.render_planned(results)
    # Every strategy with and without activation checkpointing was measured at 2 and 4 ranks, plus one rank.
    measured = {(c["strategy"], c["ranks"], c["activation_checkpointing"]) for c in results["cells"]}
    assert results["ranks"] == [1, 2, 4]
    assert {(s, n, a) for s in bench.STRATEGIES for n in (2, 4) for a in (False, True)} <= measured
    assert {("FULL_SHARD", 1, False), ("FULL_SHARD", 1, True)} <= measured
    assert all(c["peak_memory_mib"] > 0 and c["tokens_per_second"] > 0 for c in results["cells"])
    assert bench.section(text, "measured").count(bench.NEEDS_GPU) == 4 * 2 * len(results["ranks"])
    # The planner rows are today's planner: a change to litsft/training/plan.py means re-running the script.
    assert results["planner"] == bench.planner_rows(), (
        "run python benchmarks/bench_strategies.py --planner_only"
    )
