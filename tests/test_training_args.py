"""litsft/training/args.py: the run settings' defaults, the checks each option group makes on itself, the defaults
that depend on the model and the machine, and the batch arithmetic."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from litsft.errors import LitsftError
from litsft.model.config import Config
from litsft.training.args import (
    MAX_DEFAULT_SEQ_LENGTH,
    EvalConfig,
    FSDPConfig,
    LogConfig,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
    describe,
    on_cuda_by_default,
    profiled_steps,
    run_model_config,
    step_geometry,
    with_defaults,
)


def test_defaults() -> None:
    train, optimizer = TrainConfig(), OptimizerConfig()
    assert (train.global_batch_size, train.micro_batch_size, train.epochs, train.max_norm) == (16, 4, 1, 1.0)
    assert (train.max_steps, train.max_seq_length, train.compile, train.deterministic) == (
        None,
        None,
        None,
        False,
    )
    assert (optimizer.lr, optimizer.min_lr, optimizer.schedule, optimizer.betas) == (
        2e-5,
        0.0,
        "cosine",
        (0.9, 0.95),
    )
    assert (EvalConfig().max_batches, FSDPConfig().sharding_strategy) == (20, "FULL_SHARD")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TrainConfig(micro_batch_size=0), r"--train.micro_batch_size=0 must be at least 1"),
        (lambda: TrainConfig(max_norm=0.0), r"--train.max_norm=0.0 .*pass null to disable clipping"),
        (lambda: EvalConfig(max_new_tokens=-1), r"--eval.max_new_tokens=-1"),
        (lambda: OptimizerConfig(lr=1e-4, min_lr=1e-3), r"min_lr=0.001 is above --optimizer.lr=0.0001"),
        (lambda: OptimizerConfig(betas=(0.9, 1.0)), r"--optimizer.betas=1.0"),
        (lambda: OptimizerConfig(warmup_fraction=1.5), r"--optimizer.warmup_fraction=1.5"),
        (lambda: OptimizerConfig(eps=0.0), r"--optimizer.eps=0.0"),
        (
            lambda: LogConfig(profile_steps="5:3"),
            r"^--log.profile_steps='5:3': 5:3 names no step; .* start <= end$",
        ),
        (
            lambda: LogConfig(profile_steps="0"),
            r"^--log.profile_steps='0': 0 names no step; steps count from 1",
        ),
        (
            lambda: LogConfig(profile_steps="three"),
            r"^--log.profile_steps='three' is not a list of steps; write e",
        ),
        (lambda: LogConfig(profile_steps="3,"), r"^--log.profile_steps='3,' is not a list of steps"),
    ],
)
def test_each_option_group_refuses_bad_values_with_the_option_named(make, message: str) -> None:
    with pytest.raises(LitsftError, match=message):
        make()


def run_config(**train: object) -> RunConfig:
    config = Config.from_name("tiny-llama")  # context length 1024
    return RunConfig(config, None, None, Path("out"), train=TrainConfig(**train))


def test_defaults_from_the_model_and_the_machine_fill_only_what_is_unset() -> None:
    run = run_config()
    filled = with_defaults(replace(run, accelerator="cpu"), "32-true")
    assert (filled.precision, filled.train.max_seq_length, filled.train.compile) == ("32-true", 1024, False)
    assert run.precision is None and run.train.max_seq_length is None  # the original is left alone
    long_context = replace(
        run, config=replace(run.config, max_position_embeddings=131072), accelerator="cuda"
    )
    assert with_defaults(long_context, "bf16-mixed").train.max_seq_length == MAX_DEFAULT_SEQ_LENGTH
    given = replace(run_config(max_seq_length=64, compile=False), precision="bf16-true", accelerator="cuda")
    kept = with_defaults(given, "bf16-mixed")
    assert (kept.precision, kept.train.max_seq_length, kept.train.compile) == ("bf16-true", 64, False)


def test_the_load_balancing_coefficient_is_the_models_unless_given_and_refused_for_a_dense_model() -> None:
    moe = replace(run_config(), config=Config.from_name("Qwen3-30B-A3B"))
    assert with_defaults(moe, "bf16-mixed").config.router_aux_loss_coef == 0.001  # its config.json's
    given = replace(moe, train=TrainConfig(router_aux_loss_coef=0.0))
    assert with_defaults(given, "bf16-mixed").config.router_aux_loss_coef == 0.0
    assert run_model_config(given) == with_defaults(given, "bf16-mixed").config  # what a resume compares
    assert moe.config.router_aux_loss_coef == 0.001  # the original is left alone
    with pytest.raises(
        LitsftError, match="^--train.router_aux_loss_coef: tiny-llama is not a mixture of experts"
    ):
        with_defaults(run_config(router_aux_loss_coef=0.01), "bf16-mixed")
    with pytest.raises(LitsftError, match="--train.router_aux_loss_coef"):
        TrainConfig(router_aux_loss_coef=-0.1)


def test_the_balancing_bias_rate_goes_into_the_model_and_is_refused_for_a_dense_model() -> None:
    """Off unless given (transformers' families have no bias); a rate makes it the model's, which a resume
    compares; refused for a dense model and below 0."""
    moe = replace(run_config(), config=Config.from_name("Qwen3-30B-A3B"))
    assert with_defaults(moe, "bf16-mixed").config.router_bias_update_rate == 0.0
    given = replace(moe, train=TrainConfig(router_bias_update_rate=0.001))
    assert with_defaults(given, "bf16-mixed").config.router_bias_update_rate == 0.001
    with pytest.raises(
        LitsftError, match="^--train.router_bias_update_rate: tiny-llama is not a mixture of experts"
    ):
        with_defaults(run_config(router_bias_update_rate=0.01), "bf16-mixed")
    with pytest.raises(LitsftError, match="--train.router_bias_update_rate"):
        TrainConfig(router_bias_update_rate=-0.1)


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [(None, "cuda", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda", False)],
)
def test_compile_and_async_save_follow_the_setting_else_the_device(setting, device, expected) -> None:
    assert on_cuda_by_default(setting, device) is expected


def test_a_runs_step_geometry_comes_from_its_batch_sizes_and_its_processes() -> None:
    geometry = step_geometry(TrainConfig(global_batch_size=32, micro_batch_size=4), world_size=2)
    assert (geometry.samples_per_rank, geometry.accumulation_steps) == (16, 4)
    with pytest.raises(LitsftError, match="multiple of 12"):
        step_geometry(TrainConfig(global_batch_size=16, micro_batch_size=4), world_size=3)


def test_run_config_takes_the_arguments_it_knows_and_records_all() -> None:
    arguments = {"devices": 2, "seed": 3, "out_dir": Path("o"), "checkpoint_dir": Path("c"), "data": None}
    run = RunConfig.from_arguments(arguments, Config.from_name("tiny-llama"), tokenizer_dir=Path("c"))
    assert (run.devices, run.seed, run.out_dir, run.world_size) == (2, 3, Path("o"), 2)
    assert run.cli_arguments == arguments and not hasattr(run, "checkpoint_dir")


def test_describe_gives_plain_json_values() -> None:
    described = describe({"train": TrainConfig(epochs=2), "out_dir": Path("out"), "betas": (0.9, 0.95)})
    assert described["train"]["class"] == "TrainConfig" and described["train"]["epochs"] == 2
    assert (described["out_dir"], described["betas"]) == ("out", [0.9, 0.95])


def test_profile_steps_name_steps_and_ranges_with_both_ends_included() -> None:
    assert profiled_steps(None) == frozenset()
    assert profiled_steps("3") == {3}
    assert profiled_steps("3, 7") == {3, 7}
    assert profiled_steps("3:5,9") == {3, 4, 5, 9}
    assert LogConfig(profile_steps=3).profile_steps == "3"  # a number from YAML
