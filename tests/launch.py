"""Running litsft commands in fresh processes, the way users run them (Fabric spawns the extra ranks), or in
this process when what a test checks is not about processes (a single-process run, a refusal, a conversion)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_tokenizer import write_tiny_tokenizer

from litsft.checkpoint.model_folder import load_model_state_dict, save_model_folder
from litsft.model.config import Config
from litsft.model.network.transformer import Transformer

DEADLINE_S = 3600
"""How long a test waits for a process, a rank or an event before calling it hung: a deadline, never how long
the wait is expected to take. An hour, because on a loaded machine (a load average of 15 on 2 cores) every
process gets a fraction of a core: the runs that finish in tens of seconds on an idle machine, and the demo's
4 minutes, take many times that, and fixed limits of 60 to 900 s failed there."""


def test_env(tmp_path: Path) -> dict[str, str]:
    """One thread per process (2 cores, up to 2 ranks) and every cache under the test's own directory."""
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(name, None)
    env.update(
        OMP_NUM_THREADS="1",
        LITSFT_CACHE_DIR=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path),
        DATA_OPTIMIZER_CACHE_FOLDER=str(tmp_path / "litdata-cache"),
        DATA_OPTIMIZER_DATA_CACHE_FOLDER=str(tmp_path / "litdata-data"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"),
        PYTHONWARNINGS="ignore",
    )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def litsft(
    args: list[str],
    tmp_path: Path,
    timeout: float = DEADLINE_S,
    check: bool = True,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `litsft <args>` with test_env(tmp_path) updated by `env`, in `cwd`."""
    env = {**test_env(tmp_path), "MASTER_PORT": str(free_port()), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "litsft", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"litsft {args[0]} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def litsft_in_process(
    args: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`litsft <args>` called in this process, with the environment `litsft()` gives a subprocess, and this
    process's state put back afterwards (environment, signal handlers, threads, deterministic algorithms, random
    generators, the phase timer). It saves the ~7 s a fresh process spends importing torch and Lightning; keep
    `litsft()` for what only a process shows (exit on a signal, spawned ranks, what a start-up imports)."""
    from litsft.__main__ import main
    from litsft.runtime.preemption import PreemptionFlag
    from litsft.runtime.timings import run_timer

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    deterministic, rng, python_rng = (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_rng_state(),
        random.getstate(),
    )
    os.environ.update({**test_env(tmp_path), **(env or {})})
    datasets_config = sys.modules.get("datasets.config")  # read HF_DATASETS_CACHE when first imported
    saved_datasets_cache = getattr(datasets_config, "HF_DATASETS_CACHE", None)
    if datasets_config is not None:
        datasets_config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 sets it for a subprocess
    run_timer.__init__()  # the clock of a fresh process starts at its imports
    capsys.readouterr()
    try:
        main(args)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        PreemptionFlag.uninstall()
        os.environ.clear()
        os.environ.update(saved_env)
        if datasets_config is not None:
            datasets_config.HF_DATASETS_CACHE = saved_datasets_cache
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)
        random.setstate(python_rng)
    out, err = capsys.readouterr()
    result = subprocess.CompletedProcess(["litsft", *args], code, out, err)
    if check and code != 0:
        raise AssertionError(f"litsft {args[0]} exited {code}:\n{out[-3000:]}\n{err[-6000:]}")
    return result


def litsft_two_nodes(
    args: list[str], tmp_path: Path, timeout: float = DEADLINE_S, devices_per_node: int = 1
) -> None:
    """Two "nodes" of `devices_per_node` processes on 127.0.0.1, launched by torchrun as on a cluster."""
    env, port = test_env(tmp_path), free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                str(devices_per_node),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "litsft",
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    for p, out in zip(processes, outputs):
        if p.returncode != 0:
            raise AssertionError(f"node exited {p.returncode}:\n{out[-6000:]}")


TINY_PHI3 = dict(
    hf_architecture="Phi3ForCausalLM",
    rotary_fraction=0.75,
    sliding_window=16,
    rope_scaling={
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
        "original_max_position_embeddings": 32,
    },
)
"""tiny-llama made a Phi-3 model (`write_tiny_checkpoint(..., **TINY_PHI3)`): fused weights in its Hugging Face
export, 3/4 of each head rotated, LongRoPE's long factors past 32 tokens, a 16-token window."""


TINY_MOE = dict(
    hf_architecture="Qwen3MoeForCausalLM",
    num_experts=4,
    experts_per_token=2,
    expert_intermediate_size=48,
    normalize_expert_weights=True,
    qk_norm=True,
    router_aux_loss_coef=0.01,
)
"""tiny-llama made a Qwen3-MoE model: 4 experts of 48, 2 per token, the load-balancing loss on."""

EXPERT_FAMILIES = {
    "qwen3-moe": TINY_MOE,
    "olmoe": dict(
        TINY_MOE,
        hf_architecture="OlmoeForCausalLM",
        expert_intermediate_size=0,
        qk_norm_over="all_heads",
        normalize_expert_weights=False,
    ),
    "mixtral": dict(
        TINY_MOE, hf_architecture="MixtralForCausalLM", expert_intermediate_size=0, qk_norm=False
    ),
}
"""TINY_MOE as each family whose experts litsft trains: OLMoE's q/k norms over all heads and its k weights not
renormalized (norm_topk_prob false, as OLMoE-1B-7B), Mixtral without q/k norms."""


def write_tiny_checkpoint(directory: Path, seed: int = 0, model: str = "tiny-llama", **overrides) -> Path:
    """A random litsft checkpoint of the tiny named config `model` with the tiny ChatML tokenizer."""
    config = Config.from_name(model, **overrides)
    model = Transformer(config)
    model.init_weights(seed)
    directory.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(directory)
    save_model_folder(model.state_dict().items(), config, directory, directory)
    return directory


def max_difference(dir_a: Path, dir_b: Path) -> float:
    a, b = load_model_state_dict(dir_a), load_model_state_dict(dir_b)
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def stopped_copy(out_dir: Path, copy: Path, last_step: int) -> Path:
    """A copy of a finished run's out_dir as a stop before its last checkpoint leaves it: the checkpoint of
    `last_step` and the final folder gone, the earlier checkpoints there to resume from."""
    shutil.copytree(out_dir, copy)
    shutil.rmtree(copy / f"step-{last_step:08d}")
    shutil.rmtree(copy / "final")
    return copy


def state_dict(directory: Path) -> dict[str, torch.Tensor]:
    return load_model_state_dict(directory)


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def write_records(path: Path, count: int = 48, seed: int = 0) -> Path:
    """Instruction records of mixed lengths, so packing, masking and token-weighted loss all matter."""
    rng = random.Random(seed)
    records = [
        {
            "instruction": " ".join(rng.choices(WORDS, k=rng.randint(2, 12))),
            "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 10))),
        }
        for _ in range(count)
    ]
    path.write_text(json.dumps(records))
    return path


def on_ranks(
    ranks: int, job: Callable[..., Any], tmp_path: Path, *args: Any, timeout: float = DEADLINE_S
) -> dict[int, Any]:
    """rank -> what `job(*args)` returned on each of `ranks` processes forked from this one and joined in a gloo
    process group. A rank that raised fails the test with its traceback."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def run(rank: int, init_file: str, results: Any) -> None:
        torch.set_num_threads(1)
        try:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
            answer = job(*args)
            dist.destroy_process_group()
            results.put((rank, answer, None))
        except BaseException:
            results.put((rank, None, traceback.format_exc()))

    # fork, not spawn: the children reuse this process's imports and start in a fraction of a second.
    context = mp.get_context("fork")
    results = context.Queue()
    init_file = tmp_path / f"init-{job.__name__}-{free_port()}"
    workers = [context.Process(target=run, args=(rank, str(init_file), results)) for rank in range(ranks)]
    for worker in workers:
        worker.start()
    answers = [results.get(timeout=timeout) for _ in workers]
    for worker in workers:
        worker.join(timeout=DEADLINE_S)
    failures = [error for _, _, error in answers if error]
    assert not failures, failures[0]
    return {rank: answer for rank, answer, _ in answers}
