"""Download the wheels that the GPU image lacks, for its CPython 3.12 on manylinux x86_64, into `.whl/` of the
checkout (ignored by git), and check that they fit in what a GPU call may carry.

python benchmarks/gpu/prepare_wheels.py [--dest .whl] [--find-links DIR]

The GPU image has torch 2.11.0+cu130, lightning, transformers, peft, tokenizers, safetensors, huggingface_hub,
jinja2, tqdm, matplotlib, torchmetrics, pyarrow, pandas, fsspec and xxhash, and reaches no package index.
What litsft and `benchmarks/gpu/run.sh` need beyond that is listed in WHEELS, pinned, and downloaded
without dependencies (each dependency the image lacks is listed itself), so that nothing can pull another
torch. run.sh installs them with `pip install --no-index --no-deps --target`. `--find-links DIR` downloads
from a local folder instead of PyPI (what the tests do).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / ".whl"

PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")
"""The manylinux tags a wheel for the image may carry (its glibc is newer than all of them)."""

WHEELS = (
    # The command line: jsonargparse reads the recipes' signatures and docstrings.
    "jsonargparse==4.53.0", "docstring_parser==0.18.0", "typeshed_client==2.15.0",
    # Streaming data (--data LitData, litsft prepare) and what it imports.
    "litdata==0.2.76", "boto3==1.44.8", "botocore==1.44.8", "s3transfer==0.19.3", "jmespath==1.1.0",
    "obstore==0.12.1",
    # What the carried boto3 and litdata import that the image lacks: botocore imports urllib3, and accelerate
    # (in the image) imports boto3 whenever it can, so without urllib3 transformers' model classes fail to
    # import; litdata's client imports requests (its certifi and charset_normalizer; idna the image has).
    "urllib3==2.8.0", "requests==2.34.2", "certifi==2026.10.19.post1", "charset_normalizer==3.5.3",
    # --data HFDataset.
    "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19",
    # float8 training and QLoRA's NF4. 0.17.0 is the torchao release made for torch 2.11: its wheels use
    # torch's stable ABI, which needs torch 2.11 or newer ("We do require torch 2.11+", released 2026-03-25:
    # https://github.com/pytorch/ao/commit/f0f9a052657e062d0d5e5739aebf6aae8f852cb8); 0.18.0 was built and
    # tested against torch 2.13 (its CI installs torch==2.13.0:
    # https://github.com/pytorch/ao/blob/v0.18.0/.github/workflows/regression_test.yml).
    "torchao==0.17.0",
    # The tests, and building litsft's own wheel from the checkout (setuptools>=77: pyproject.toml).
    "pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "pygments==2.21.0",
    "setuptools==84.2.1", "wheel==0.48.0", "packaging==26.4",
)  # fmt: skip

CARRY_LIMIT_MIB = 64
"""What one GPU call may carry, checkout included."""
WHEELS_LIMIT_MIB = 48
"""What the wheels may take of it: the rest is the checkout's."""
FORBIDDEN = ("torch", "triton")
"""Distributions never carried (nor any nvidia-*): the image's own torch, Triton and CUDA libraries are the ones
to run against."""


def download_command(dest: Path, find_links: Path | None = None) -> list[str]:
    """The `pip download` of WHEELS for the image's Python and platform, from PyPI or a local folder."""
    command = [
        sys.executable, "-m", "pip", "download", "--dest", str(dest), "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *(option for platform in PLATFORMS for option in ("--platform", platform)),
    ]  # fmt: skip
    if find_links is not None:  # that folder only: no index, and no pip configuration or PIP_* variables
        command += ["--isolated", "--no-index", "--find-links", str(find_links)]
    return [*command, *WHEELS]


def distribution_name(wheel: Path) -> str:
    """The normalized project name a wheel file carries (`Foo_Bar-1.0-py3-none-any.whl` -> `foo-bar`)."""
    return wheel.name.split("-", 1)[0].lower().replace("_", "-")


def check_wheels(dest: Path, limit_mib: float = WHEELS_LIMIT_MIB) -> float:
    """The wheels' total size in MiB; raises SystemExit with one line when one is missing, one is torch or a
    CUDA library, a stale extra wheel is there, or they do not fit in `limit_mib`."""
    wheels = sorted(dest.glob("*.whl"))
    names = {distribution_name(wheel) for wheel in wheels}
    wanted = {requirement.split("==")[0].lower().replace("_", "-") for requirement in WHEELS}
    forbidden = sorted(name for name in names if name in FORBIDDEN or name.startswith("nvidia-"))
    if forbidden:
        raise SystemExit(
            f"error: {dest} holds {', '.join(forbidden)}: the image's own torch must be used; delete them"
        )
    if wanted - names:
        raise SystemExit(
            f"error: {dest} lacks wheels for {', '.join(sorted(wanted - names))}; run this script again"
        )
    if names - wanted:
        raise SystemExit(
            f"error: {dest} holds wheels not in the list ({', '.join(sorted(names - wanted))}); delete {dest} and "
            "run this script again"
        )
    total_mib = sum(wheel.stat().st_size for wheel in wheels) / 2**20
    if total_mib > limit_mib:
        raise SystemExit(
            f"error: the wheels in {dest} take {total_mib:.1f} MiB, over the {limit_mib} MiB kept for them of the "
            f"{CARRY_LIMIT_MIB} MiB a GPU call carries; drop a package or pick smaller versions"
        )
    return total_mib


def carry_message(dest: Path, total_mib: float) -> str:
    """What to tell the person who launches the GPU run."""
    try:
        folder = dest.resolve().relative_to(REPO)
    except ValueError:
        folder = dest
    return (
        f"{len(list(dest.glob('*.whl')))} wheels, {total_mib:.1f} MiB (limit {WHEELS_LIMIT_MIB} of "
        f"{CARRY_LIMIT_MIB} MiB): carry {folder} with the checkout, then run `bash benchmarks/gpu/run.sh`"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--find-links", type=Path, default=None, help="a local folder instead of PyPI")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(download_command(args.dest, args.find_links), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: pip download failed:\n{result.stderr[-3000:]}")
    print(carry_message(args.dest, check_wheels(args.dest)))


if __name__ == "__main__":
    main()
