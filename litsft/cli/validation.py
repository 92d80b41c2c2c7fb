"""Checks run before any process is spawned: each failure is one LitsftError naming the value and the fix,
and nothing in out_dir or the inputs is touched before they pass.

`check_data` opens the data before a recipe converts or downloads its model; `check_run` reads only the
arguments and files, without torch, so a bad command line is refused before torch or Lightning is imported;
`check_machine` asks torch about the GPUs.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litsft.checkpoint.checkpoint_dirs import (
    FINAL_DIR,
    STEP_PREFIX,
    TRAINER_STATE,
    complete_checkpoints_after,
    find_damage,
    read_trainer_state,
    resume_checkpoint,
)
from litsft.errors import LitsftError, check_number
from litsft.model.precision.float8 import check_float8_device, check_float8_recipe
from litsft.runtime.processes import check_world_size, is_first_process
from litsft.training.args import (
    CONFIG_OPTIONS,
    FSDPConfig,
    ObjectiveConfig,
    RunConfig,
    describe,
    run_model_config,
)
from litsft.training.devices import check_devices, gpu_has_bf16

if TYPE_CHECKING:
    from litsft.data.base import DataModule


NO_DATA = "no data given; pass e.g. --data JSON --data.json_path train.json, or --data Demo"


def check_run(run: RunConfig, recipe_name: str) -> None:
    """Everything about a run's arguments and files that can be known wrong before launch, cheapest first."""
    check_positive(run)
    check_world_size(run.devices, run.num_nodes)
    run.layout.check_heads(run.config.num_heads, run.config.name)  # the layout refuses what cannot split
    run.layout.check_experts(run.config.num_experts, run.config.name)
    check_float8_recipe(run.train.float8, recipe_name)
    if run.objective.reference == "live" and recipe_name != "finetune_lora":
        raise LitsftError(
            f"--objective.reference live scores the reference with LoRA's adapters switched off; {recipe_name} "
            "trains every weight: use --objective.reference precomputed (the default)"
        )
    if run.objective.pairs and run.parallel.context > 1:
        raise LitsftError(
            f"--objective.name {run.objective.name} with --parallel.context {run.parallel.context}: preference "
            "objectives score whole sequences, which context parallelism splits over ranks; use --parallel.context 1"
        )
    if recipe_name == "finetune_lora" and (
        run.train.router_bias_update_rate or run.config.router_bias_update_rate
    ):
        raise LitsftError(
            "--train.router_bias_update_rate is for finetune_full and pretrain: finetune_lora saves only "
            "its adapters, and the routers' moving biases would be lost; drop the flag, or use finetune_full"
        )
    max_length = run.config.max_position_embeddings
    if run.train.max_seq_length is not None and run.train.max_seq_length > max_length:
        raise LitsftError(
            f"--train.max_seq_length={run.train.max_seq_length} exceeds the model's context length "
            f"{max_length}; use at most {max_length}"
        )
    if run.data is None:
        raise LitsftError(NO_DATA)
    check_tokenizer(run.tokenizer_dir, run.config.vocab_size)
    if run.eval.tasks is not None:
        from litsft.inference.evaluate import check_chat_template, find_tasks, load_tasks

        load_tasks(*find_tasks(run.eval.tasks, run.eval.include_path), "--eval.tasks")
        if run.tokenizer_dir is not None:
            check_chat_template(
                run.tokenizer_dir,
                run.eval.apply_chat_template,
                "--eval.apply_chat_template",
                f"the tokenizer in {run.tokenizer_dir}",
            )
    check_out_dir(run, recipe_name)


def check_data(
    data: DataModule | None, tokenizer_dir: Path | None, objective: ObjectiveConfig | None = None
) -> None:
    """The data opened and its first records read (and rendered with the model's chat template when its
    tokenizer is on disk already): what recipes check first, before a model is converted or downloaded and
    before any process starts, so that a bad dataset is refused in seconds. A preference `objective` reads
    the records as pairs (`SFTDataModule.train_pairs`)."""
    if data is None:
        raise LitsftError(NO_DATA)
    if objective is not None and objective.pairs:
        if not hasattr(data, "train_pairs"):
            raise LitsftError(
                f"--objective.name {objective.name} trains on preference pairs, which --data "
                f"{type(data).__name__} does not hold; give records with 'chosen' and 'rejected' through "
                "--data JSON or --data HFDataset"
            )
        data.train_pairs()
    data.check(tokenizer_dir)


def check_machine(run: RunConfig, gpus: int) -> None:
    """What a run (its accelerator chosen) asks of the machine: a GPU per process, bf16 support, ..."""
    check_devices(run.accelerator, run.devices, gpus)
    check_precision(run.precision, run.accelerator)
    check_fsdp_options(run.devices * run.num_nodes, run.precision, run.fsdp, run.accelerator)
    if run.train.float8 is not None:
        capability, name = None, ""
        if run.accelerator == "cuda":
            import torch

            capability, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
        check_float8_device(run.train.float8, run.precision, run.accelerator, capability, name)


def check_fsdp_options(world_size: int, precision: str, fsdp: FSDPConfig, accelerator: str) -> None:
    """Refuse, in one line, the combinations that `parallel.build_fabric` would otherwise run differently
    from what they ask for, or crash on."""
    if fsdp.cpu_offload and accelerator == "cpu":
        raise LitsftError(
            "--fsdp.cpu_offload needs GPUs: on a CPU-only machine everything already lives in CPU memory"
        )
    if fsdp.cpu_offload and world_size == 1:
        # FSDP2 does the offloading, and one process trains without FSDP: the option would change nothing.
        raise LitsftError(
            "--fsdp.cpu_offload needs 2 or more GPUs (it is FSDP's, and one GPU trains without FSDP); on one "
            "GPU drop it and save memory with finetune_lora, --fsdp.activation_checkpointing true or a smaller "
            "--train.micro_batch_size"
        )
    if precision == "16-mixed" and world_size > 1:
        # Lightning's ModelParallelStrategy (FSDP2) takes no 16-mixed and would stop with its own error
        # (`mp_precision_supported` in lightning/fabric/connector.py).
        raise LitsftError(
            "--precision 16-mixed runs on one GPU only (FSDP2 here takes no fp16 autocast with loss scaling); "
            "with several GPUs use bf16-mixed (Ampere or newer) or 32-true"
        )


def check_positive(run: RunConfig) -> None:
    # The train.*, eval.* and optimizer.* options are checked where they are declared (__post_init__).
    check_number("--devices", run.devices, at_least=1)
    check_number("--num_nodes", run.num_nodes, at_least=1)


def check_precision(precision: str, accelerator: str) -> None:
    if accelerator == "cpu":
        if precision == "16-mixed":
            raise LitsftError(
                "--precision 16-mixed needs a CUDA GPU (fp16 autocast with loss scaling); on CPU use 32-true "
                "or bf16-mixed"
            )
        return
    import torch

    if precision.startswith("bf16") and not gpu_has_bf16():
        raise LitsftError(
            f"--precision {precision}: this GPU ({torch.cuda.get_device_name()}) has no bfloat16 support; "
            "use 16-mixed or 32-true"
        )


def check_tokenizer(tokenizer_dir: Path | None, vocab_size: int) -> None:
    """Token ids at or past the embedding table's size would index out of range in the first forward."""
    if tokenizer_dir is None:
        return
    from litsft.data.tokenizer import Tokenizer

    tokens = Tokenizer(tokenizer_dir).vocab_size
    if tokens > vocab_size:
        raise LitsftError(
            f"the tokenizer in {tokenizer_dir} has {tokens} tokens but the model's vocab_size is {vocab_size}: "
            "ids past the embedding table would crash training; use the tokenizer the model was trained with"
        )


def check_out_dir(run: RunConfig, recipe_name: str) -> None:
    """A finished run is never overwritten, a fresh start never writes over checkpoints, and a resume
    checkpoint must come from the same recipe and model."""
    out_dir = run.out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise LitsftError(f"--out_dir {out_dir} is a file; pass a directory")
    final = out_dir / FINAL_DIR
    if final.exists():
        raise LitsftError(
            f"{final} exists: this run has finished; pass another --out_dir, or delete {final} to train again"
        )
    if run.resume is False and any(out_dir.glob(f"{STEP_PREFIX}*")):
        raise LitsftError(
            f"--resume false but {out_dir} holds checkpoints of an earlier run; pass --resume auto to continue "
            "it, or another --out_dir to start over"
        )
    path = resume_checkpoint(run.resume, out_dir)
    if path is not None:
        state = check_resumable(path, run, recipe_name)
        if run.resume not in ("auto", True):
            check_named_checkpoint_contents(path)
        check_no_later_checkpoints(path, state["step"], out_dir)
        notice = schedule_changes(path, state, run)
        if notice is not None and is_first_process():
            print(notice, flush=True)


def check_named_checkpoint_contents(path: Path) -> None:
    """A checkpoint named by --resume has its files' checksums checked before launch: a damaged one is not
    moved aside (the run would not go on from the one the user named), it is refused. (--resume auto's
    checkpoint is checked once the run starts, where a damaged one gives way to the one before.)"""
    damage = find_damage(path, contents=True)
    if damage is not None:
        raise LitsftError(
            f"--resume {path} is damaged: {damage}; pass an older step dir, or --resume auto to go on from "
            "the newest intact checkpoint of --out_dir"
        )


def check_no_later_checkpoints(path: Path, step: int, out_dir: Path) -> None:
    """A run resumed from an earlier step (--resume <dir>, at `step`) must not reach a step whose checkpoint
    out_dir holds already: it would fail there, its steps since the resume lost, as each relaunch of it would."""
    later = complete_checkpoints_after(out_dir, step)
    if later:
        names = ", ".join(p.name for p in later[:3]) + (
            f" and {len(later) - 3} more" if len(later) > 3 else ""
        )
        raise LitsftError(
            f"--resume {path} starts at step {step} but {out_dir} holds checkpoints of later steps ({names}), "
            f"which this run would write again; move them out of {out_dir} to go on from step {step} there, "
            "or pass another --out_dir"
        )


def check_resumable(path: Path, run: RunConfig, recipe_name: str) -> dict[str, Any]:
    """Refuse in one line a checkpoint this run cannot continue; return its trainer state."""
    state = read_trainer_state(path)
    if not isinstance(state.get("step"), int):
        raise LitsftError(
            f"{path / TRAINER_STATE} records no step, so {path} is damaged; move it aside (rename it) to resume "
            "from the checkpoint before it, or pass --resume <an older step dir>"
        )
    if state.get("recipe") != recipe_name:
        raise LitsftError(
            f"{path} was written by {state.get('recipe')}, not {recipe_name}; resume it with "
            f"`litsft {state.get('recipe')}` or pass another --out_dir"
        )
    data = run.data.fingerprint()
    if state.get("data") is not None and data is not None and state["data"] != data:
        raise LitsftError(
            f"{path} was trained on other data than --data gives now (data fingerprint {state['data'][:12]}, "
            f"now {data[:12]}); resume with the data it was trained on, or pass another --out_dir to start over"
        )
    # The model as this run will build it, the command line's changes included, as the checkpoint recorded it.
    saved, current = state.get("config", {}), _json_round_trip(asdict(run_model_config(run)))
    different = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if different:
        key = different[0]
        fix = (
            f"pass {CONFIG_OPTIONS[key]} {saved.get(key)} as it was trained with"
            if key in CONFIG_OPTIONS
            else "pass the checkpoint_dir it was trained from"
        )
        raise LitsftError(
            f"{path} was written for a different model ({key}={saved.get(key)!r}, this run has "
            f"{current.get(key)!r}); {fix}, or another --out_dir"
        )
    return state


def schedule_changes(path: Path, state: dict[str, Any], run: RunConfig) -> str | None:
    """One line naming the optimizer and run-length settings that differ from those the checkpoint `path`
    (its trainer state `state`) was trained with (resuming applies the new ones from its step, so the
    learning rate may jump); None when none do."""
    saved, current = state.get("arguments", {}), _json_round_trip(describe(run.cli_arguments))
    changes = [
        f"--{group}.{key} {saved[group].get(key)} -> {value}"
        for group, keys in (("optimizer", None), ("train", ("max_steps", "epochs", "global_batch_size")))
        if isinstance(saved.get(group), dict) and isinstance(current.get(group), dict)
        for key, value in current[group].items()
        if (keys is None or key in keys) and saved[group].get(key) != value
    ]
    if not changes:
        return None
    return (
        f"Resuming {path} with other settings than it was trained with ({', '.join(changes)}): they apply from "
        f"step {state.get('step')} on, so the learning rate may jump there"
    )


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
