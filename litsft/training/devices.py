"""Which accelerator a run uses and whether the machine has the devices it asks for.

The choices are pure functions of the request and the number of CUDA GPUs found (`gpu_count`), so they are
tested on any machine with made-up counts. `--accelerator auto` means CUDA when there is a GPU; on the CPU,
`--devices N` is N processes talking over gloo, which any machine can run. torch is imported only to count
or query GPUs: the checks before launch run without it otherwise.
"""

from __future__ import annotations

from typing import Literal

from litsft.errors import LitsftError
from litsft.training.args import Accelerator, Precision

Device = Literal["cpu", "cuda"]


def gpu_count() -> int:
    """CUDA GPUs this process can see (0 on a CPU-only build or machine)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_has_bf16() -> bool:
    """Whether this machine's GPU computes in bfloat16 (compute capability 8.0, Ampere, or newer).

    Not `torch.cuda.is_bf16_supported()` as called bare: it also says yes for a V100 or T4, where bf16 tensors
    exist but are emulated (its `including_emulation=True` default), so mixed precision would run without
    tensor cores."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def default_precision(accelerator: Device) -> Precision:
    """bf16-mixed where the GPU has bf16, else full precision."""
    if accelerator == "cuda" and gpu_has_bf16():
        return "bf16-mixed"
    return "32-true"


def choose_accelerator(requested: Accelerator, gpus: int) -> Device:
    """auto: CUDA when there is a GPU, else the CPU; cuda on a machine without one is refused."""
    if requested == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if requested == "cuda" and gpus == 0:
        raise LitsftError(
            "--accelerator cuda: this machine has no CUDA GPU that torch can use (found 0); pass "
            "--accelerator cpu, or install a CUDA build of torch"
        )
    return requested


def check_devices(accelerator: Device, devices: int, gpus: int) -> None:
    """A GPU run needs one GPU per process on each node."""
    if accelerator == "cuda" and devices > gpus:
        raise LitsftError(
            f"--devices {devices} asks for {devices} GPUs per node but this machine has {gpus}; pass "
            f"--devices {gpus}, or --accelerator cpu to run {devices} processes on the CPU"
        )


def demo_accelerator(requested: Accelerator, devices: int, gpus: int) -> Device:
    """The demo trains wherever it is started: on the GPUs when there are enough for --devices, otherwise
    (no GPU, or fewer than asked) as CPU processes, unless --accelerator cuda insists on GPUs."""
    if requested == "auto":
        return "cuda" if gpus >= devices else "cpu"
    accelerator = choose_accelerator(requested, gpus)
    check_devices(accelerator, devices, gpus)
    return accelerator
