"""The tree's two rules. Tests mirror modules: every module of litsft/ (and of recipes/, shipped as litsft.recipes)
has a test file named after it, tests/test_<module>.py or tests/test_<package>_<module>.py, or is one of the few
listed in TESTED_ELSEWHERE, whose test file names it; a module added without tests fails here, by name. Imports
run only downwards through LAYERS (errors < runtime < model < data < checkpoint < huggingface < inference < training < cli <
__main__ and recipes), read from the source with ast; an import up a layer fails here, naming both ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PACKAGES = {"litsft": REPO / "litsft", "litsft.recipes": REPO / "recipes"}

TESTED_ELSEWHERE = {
    "litsft.__main__": "test_main.py",  # the `litsft` command
    "litsft.data.json_data": "test_data_json.py",  # `--data JSON`
    "litsft.model.families.spec": "test_model_families.py",  # the weight maps, next to the families that use them
    "litsft.recipes.finetune_full": "test_training_engine.py",  # the engine's whole runs are full fine-tuning runs
}
FAMILY_TESTS = "test_model_families.py"
"""Every litsft/model/families/<module>.py: one section per module there, parametrized over that folder's files."""
ADAPTER_TESTS = "test_model_lora_variants.py"
"""Every litsft/model/lora/variants/<variant>.py: tests parametrized over the registry, and a section per variant."""


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module; a package's __init__ (its re-exports) is tested through them."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] != "__init__":
                found[".".join((package, *parts))] = path
    return found


def expected_test_file(module: str) -> str:
    if module in TESTED_ELSEWHERE:
        return TESTED_ELSEWHERE[module]
    parts = module.removeprefix("litsft.recipes.").removeprefix("litsft.").split(".")
    if parts[:2] == ["model", "families"]:
        return FAMILY_TESTS
    if parts[:3] == ["model", "lora", "variants"]:
        return ADAPTER_TESTS
    return "test_" + "_".join(parts) + ".py"


def test_the_modules_are_found() -> None:
    found = modules()
    assert {
        "litsft.model.network.loss",
        "litsft.data.base",
        "litsft.checkpoint.checkpoint_dirs",
        "litsft.recipes.pretrain",
    } <= set(found)
    assert not any(name.endswith("__init__") for name in found)
    assert expected_test_file("litsft.checkpoint.checkpoint_dirs") == "test_checkpoint_checkpoint_dirs.py"
    assert expected_test_file("litsft.recipes.finetune_lora") == "test_finetune_lora.py"
    assert expected_test_file("litsft.model.families.qwen3") == "test_model_families.py"
    assert expected_test_file("litsft.model.lora.variants.pissa") == "test_model_lora_variants.py"


def test_every_module_has_a_test_file_named_after_it() -> None:
    missing = [
        f"{module} ({path.relative_to(REPO)}): add tests/{expected_test_file(module)}"
        for module, path in modules().items()
        if not (TESTS / expected_test_file(module)).is_file()
    ]
    assert not missing, "modules without tests:\n" + "\n".join(missing)


def test_each_module_tested_elsewhere_exists_and_is_named_by_its_test_file() -> None:
    found = modules()
    for module, test_file in TESTED_ELSEWHERE.items():
        assert module in found, f"{module} is listed in TESTED_ELSEWHERE but no longer exists"
        text = (TESTS / test_file).read_text()
        path = str(found[module].relative_to(REPO))
        named = module in text or path in text
        assert named, f"tests/{test_file} names neither {module} nor {path}"


LAYERS = (
    ("litsft", "litsft.errors"),
    ("litsft.runtime",),
    ("litsft.model",),
    ("litsft.data",),
    ("litsft.checkpoint",),
    ("litsft.huggingface",),
    ("litsft.inference",),
    ("litsft.training",),
    ("litsft.cli",),
    ("litsft.__main__", "litsft.recipes"),
)
"""The one rule of the tree, lowest first: a module imports only from its own layer and the layers below it."""


def layer_of(module: str) -> int:
    """The layer of a dotted litsft name: that of the longest name in LAYERS it is or lies under (the bare
    `litsft`, the torch-free package root, holds only itself, so a new package must be given a layer)."""
    best, depth = None, 0
    for index, names in enumerate(LAYERS):
        for name in names:
            under = name != "litsft" and module.startswith(name + ".")
            if (module == name or under) and name.count(".") + 1 > depth:
                best, depth = index, name.count(".") + 1
    assert best is not None, f"{module} is in no layer: add its package to LAYERS in tests/test_layout.py"
    return best


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every litsft name a module's source imports, at the top, inside functions or under TYPE_CHECKING."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from litsft.model import network` imports litsft.model.network; a name that is not a module
            # (`from litsft.errors import LitsftError`) lands in the same layer as its module either way.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "litsft" or name.startswith("litsft.")}


def up_arrows(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """`importer -> imported` for each import that runs from a lower layer up to a higher one."""
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        for imported in sorted(imported_modules(source, module, is_package)):
            if layer_of(imported) > layer_of(module):
                found.append(f"{module} -> {imported}")
    return found


def all_sources() -> dict[str, tuple[str, bool]]:
    """Dotted name -> (source, is a package's __init__) of every module of litsft/ and recipes/."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            found[name] = (path.read_text(), is_package)
    return found


def test_imports_run_only_downwards() -> None:
    arrows = up_arrows(all_sources())
    assert not arrows, (
        "imports from a lower layer up to a higher one (order: "
        + " < ".join("/".join(names) for names in LAYERS)
        + "):\n"
        + "\n".join(arrows)
    )


def test_an_up_arrow_is_caught_wherever_the_import_hides() -> None:
    """The check reads imports inside functions, under TYPE_CHECKING and relative ones, and lets downward ones pass."""
    sources = {
        "litsft.model.config": ("def f():\n    from litsft.training.args import TrainArgs\n", False),
        "litsft.runtime.files": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import litsft.cli\n",
            False,
        ),
        "litsft.data.base": ("from ..checkpoint import model_folder\n", False),
        "litsft.training.engine": (
            "from litsft.model import network\nfrom litsft.errors import LitsftError\n",
            False,
        ),
        "litsft.recipes.pretrain": ("from litsft.cli.launcher import launch\n", False),
    }
    assert up_arrows(sources) == [
        "litsft.data.base -> litsft.checkpoint.model_folder",
        "litsft.model.config -> litsft.training.args.TrainArgs",
        "litsft.runtime.files -> litsft.cli",
    ]


def test_every_package_of_litsft_has_a_layer() -> None:
    with pytest.raises(AssertionError, match="litsft.kernels.fused is in no layer"):
        layer_of("litsft.kernels.fused")
    packages = {"litsft." + path.parent.relative_to(PACKAGES["litsft"]).as_posix().replace("/", ".")
                for path in PACKAGES["litsft"].glob("*/__init__.py")}  # fmt: skip
    for package in packages | {"litsft.recipes"}:
        layer_of(package)
