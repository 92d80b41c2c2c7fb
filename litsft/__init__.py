"""litsft: pretraining and supervised fine-tuning of decoder-only LLMs with Lightning Fabric.

Importing the package imports no torch (`litsft --help` stays fast). It does one thing: from a source checkout
it binds `litsft.recipes` to that checkout's recipes/ (see `_bind_checkout_recipes`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _bind_checkout_recipes() -> None:
    """Make `litsft.recipes` this checkout's recipes/ when litsft is imported from a source checkout.

    In a wheel the recipes are installed as litsft/recipes/ and the ordinary import finds them. In a checkout
    they lie beside litsft/ and become `litsft.recipes` only through pyproject's package-dir, which only an
    installation knows about: with a checkout on PYTHONPATH and another copy of litsft installed (an
    editable install of another checkout), `import litsft.recipes` would load that copy's recipes into this
    copy's engine. Binding the package here makes that impossible; the submodules are then found under it.
    """
    root = Path(__file__).resolve().parent.parent
    recipes = root / "recipes"
    pyproject = root / "pyproject.toml"
    if "litsft.recipes" in sys.modules or not (recipes / "__init__.py").is_file() or not pyproject.is_file():
        return
    if 'name = "litsft"' not in pyproject.read_text(encoding="utf-8"):
        return  # litsft/ copied into another project, whose recipes/ is not ours
    spec = importlib.util.spec_from_file_location(
        "litsft.recipes", recipes / "__init__.py", submodule_search_locations=[str(recipes)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["litsft.recipes"] = module
    spec.loader.exec_module(module)
    globals()["recipes"] = module  # what the import system sets on a parent package after importing a child


_bind_checkout_recipes()
