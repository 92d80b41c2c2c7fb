"""The accelerator and device-count choices, as pure functions of made-up GPU counts (so a CPU machine
tests the GPU cases too), and the one-line refusal a real run gives."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import litsft_in_process, write_records, write_tiny_checkpoint
from test_training_engine import finetune_args

from litsft.errors import LitsftError
from litsft.training.devices import check_devices, choose_accelerator, demo_accelerator, gpu_count


@pytest.mark.parametrize(
    ("requested", "gpus", "expected"),
    [("auto", 0, "cpu"), ("auto", 1, "cuda"), ("auto", 8, "cuda"), ("cpu", 8, "cpu"), ("cuda", 2, "cuda")],
)
def test_auto_means_cuda_when_present(requested, gpus, expected) -> None:
    assert choose_accelerator(requested, gpus) == expected


def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(LitsftError, match=r"--accelerator cuda: this machine has no CUDA GPU .* \(found 0\)"):
        choose_accelerator("cuda", 0)


def test_more_gpus_than_the_machine_has_is_one_line_naming_the_count() -> None:
    check_devices("cuda", 4, 4)
    check_devices("cpu", 16, 0)  # CPU processes: any machine runs them
    with pytest.raises(LitsftError) as error:
        check_devices("cuda", 2, 1)
    assert str(error.value) == (
        "--devices 2 asks for 2 GPUs per node but this machine has 1; pass --devices 1, or --accelerator cpu "
        "to run 2 processes on the CPU"
    )


@pytest.mark.parametrize(
    ("requested", "devices", "gpus", "expected"),
    [
        ("auto", 2, 0, "cpu"),  # CPU-only machine: 2 processes over gloo
        ("auto", 2, 1, "cpu"),  # one GPU cannot hold 2 ranks: the CPU path, not a crash
        ("auto", 2, 2, "cuda"),
        ("auto", 4, 8, "cuda"),
        ("auto", 1, 1, "cuda"),
        ("cpu", 2, 8, "cpu"),
    ],
)
def test_the_demo_trains_with_what_the_machine_has(requested, devices, gpus, expected) -> None:
    assert demo_accelerator(requested, devices, gpus) == expected


def test_the_demo_asked_for_cuda_needs_enough_gpus() -> None:
    with pytest.raises(LitsftError, match="--devices 2 asks for 2 GPUs per node but this machine has 1"):
        demo_accelerator("cuda", 2, 1)


def test_a_recipe_asked_for_more_gpus_than_present_stops_before_anything(tmp_path: Path, capsys) -> None:
    base = write_tiny_checkpoint(tmp_path / "base")
    data = write_records(tmp_path / "data.json", count=16)
    args = finetune_args(base, data, tmp_path / "out", 2, 1, "--accelerator", "cuda", "--devices", "64")
    result = litsft_in_process(args, tmp_path, capsys, check=False)
    found = gpu_count()
    expected = (
        "error: --devices 64 asks for 64 GPUs per node but this machine has"
        if found
        else "error: --accelerator cuda: this machine has no CUDA GPU that torch can use (found 0)"
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("major", "expected"), [(7, False), (8, True)])
def test_a_gpu_whose_bf16_is_emulated_has_no_bf16(major, expected, monkeypatch):
    """A V100 (compute capability 7.0) can hold bf16 tensors, so torch.cuda.is_bf16_supported() says yes, but
    it computes them without tensor cores: recipes then default to 32-true and refuse bf16 precisions."""
    import types

    import torch

    from litsft.training.devices import default_precision, gpu_has_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(major=major)
    )
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    assert torch.cuda.is_bf16_supported()  # emulation counts as support there
    assert gpu_has_bf16() is expected
    assert default_precision("cuda") == ("bf16-mixed" if expected else "32-true")
