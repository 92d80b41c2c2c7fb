"""The wheel carries the recipes: `litsft finetune_full` works from an installed package, not only a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_recipes_ship_in_the_wheel_and_run_from_an_installed_package(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("litsft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for recipe in ("finetune_full", "finetune_lora", "pretrain"):
        assert f"litsft/recipes/{recipe}.py" in names
    assert "litsft/data/demo.py" in names and not any(name.startswith("recipes/") for name in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)  # fmt: skip
    # From a directory outside the checkout, with only the installed copy on the path.
    probe = (
        "import litsft.recipes.finetune_full as r, litsft.__main__ as m; "
        "print(r.__file__); m.main(['finetune_full', '--help'])"
    )
    # The environment is kept (a GPU machine's driver and library variables), only the path is replaced.
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=True)  # fmt: skip
    module_file = next(line for line in result.stdout.splitlines() if line.endswith("finetune_full.py"))
    assert module_file.startswith(str(target)), result.stdout[:2000]
    assert "--fsdp.sharding_strategy" in result.stdout
