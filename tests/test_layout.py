"""Tests mirror modules: every module of litsft/ (and of recipes/, shipped as litsft.recipes) has a test file
named after it, tests/test_<module>.py or tests/test_<package>_<module>.py, or is one of the few listed in
TESTED_ELSEWHERE, whose test file names it. A module added without tests fails here, by name."""

from __future__ import annotations

from pathlib import Path

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
    return "test_" + "_".join(parts) + ".py"


def test_the_modules_are_found() -> None:
    found = modules()
    assert {
        "litsft.model.loss",
        "litsft.data.base",
        "litsft.checkpoint.checkpoint_dirs",
        "litsft.recipes.pretrain",
    } <= set(found)
    assert not any(name.endswith("__init__") for name in found)
    assert expected_test_file("litsft.checkpoint.checkpoint_dirs") == "test_checkpoint_checkpoint_dirs.py"
    assert expected_test_file("litsft.recipes.finetune_lora") == "test_finetune_lora.py"
    assert expected_test_file("litsft.model.families.qwen3") == "test_model_families.py"


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
