"""The wheel carries the recipes: `litsft finetune_full` works from an installed package, not only a checkout."""

from __future__ import annotations

import os
import shutil
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
    assert not any(name.startswith("recipes/") for name in names)
    # Every module of the checkout ships: a package left out of pyproject's list would be missing here.
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "litsft").rglob("*.py")}
    assert modules - set(names) == set()

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


def _copy_of_the_checkout(root: Path) -> Path:
    for part in ("litsft", "recipes"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "README.md", root / "README.md")
    return root


def test_a_checkout_on_the_path_runs_its_own_recipes_while_another_copy_is_installed(tmp_path: Path) -> None:
    """A checkout on PYTHONPATH and another checkout installed editable (pip's finder maps `litsft.recipes` to
    that one's recipes/): the recipes imported are the checkout's. Without litsft/__init__'s binding (the
    second copy below has it emptied) they were the installed copy's, run by this copy's engine."""
    installed = _copy_of_the_checkout(tmp_path / "installed")
    site_dir = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "-e", str(installed),
         "--target", str(site_dir)],
        check=True, capture_output=True,
    )  # fmt: skip
    fixed = _copy_of_the_checkout(tmp_path / "checkout")
    unfixed = _copy_of_the_checkout(tmp_path / "unfixed")
    (unfixed / "litsft" / "__init__.py").write_text("")
    # -S and addsitedir: the installed copy's site directory is the only one, processed as a venv's would be
    # (its .pth installs pip's editable finder), after the checkout on PYTHONPATH.
    probe = (
        f"import site; site.addsitedir({str(site_dir)!r}); import importlib.util, litsft.recipes; "
        "print(litsft.__file__); print(litsft.recipes.__file__); "
        "print(importlib.util.find_spec('litsft.recipes.finetune_full').origin)"
    )

    def imported_from(checkout: Path) -> list[str]:
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env,
                                capture_output=True, text=True, check=True)  # fmt: skip
        return result.stdout.splitlines()

    assert imported_from(fixed) == [
        str(fixed / "litsft" / "__init__.py"),
        str(fixed / "recipes" / "__init__.py"),
        str(fixed / "recipes" / "finetune_full.py"),
    ]
    assert imported_from(unfixed) == [
        str(unfixed / "litsft" / "__init__.py"),
        str(installed / "recipes" / "__init__.py"),
        str(installed / "recipes" / "finetune_full.py"),
    ]


def test_litsft_copied_into_another_project_leaves_that_projects_recipes_alone(tmp_path: Path) -> None:
    """The binding needs litsft's own pyproject.toml beside recipes/: another project's recipes/ is not bound."""
    shutil.copytree(REPO / "litsft", tmp_path / "litsft", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    probe = "import sys, litsft; print('litsft.recipes' in sys.modules, hasattr(litsft, 'recipes'))"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env,
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert result.stdout.split() == ["False", "False"]
