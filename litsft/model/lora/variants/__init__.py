"""Adapter variants: one module per variant (lora, rslora, dora, ...) owns everything that
differs between them, and the rest of litsft looks a variant up by `--lora.variant` and never names one.

A variant module defines `VARIANT`, an instance of a subclass of `litsft.model.lora.variants.spec.AdapterVariant`,
whose methods say how its adapters are scaled, built, initialized from the base weights, run in the forward
pass, merged into a base weight, exported to PEFT, trained (the learning rate of each adapter parameter)
and checked against a run's settings. The defaults are plain LoRA's; a variant overrides what it changes.

This package's `__init__` imports no torch: the CLI reads the variant names (`--lora.variant`'s choices)
from the module files here without importing them; `adapter_variant(name)` imports one when it is used.

Adding a variant: one module here, plus its tests in tests/test_model_lora_variants.py (the registry-wide tests
there run it at once). litsft.model.lora.layers, the memory planner, the LoRA folder, the PEFT export and the
recipe do not change.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

_NOT_VARIANTS = {"spec"}
VARIANT_NAMES: tuple[str, ...] = tuple(
    sorted(
        (info.name for info in pkgutil.iter_modules(__path__) if info.name not in _NOT_VARIANTS),
        key=lambda name: (name != "lora", name),  # plain LoRA, the default, first
    )
)
"""Every variant, by the name `--lora.variant` takes: the modules of this package."""


def adapter_variant(name: str) -> Any:
    """The variant called `name` (one of VARIANT_NAMES): its module's `VARIANT`, an `AdapterVariant` of
    litsft.model.lora.variants.spec (not named in the signature, which would make this torch-free module import it)."""
    if name not in VARIANT_NAMES:
        raise KeyError(f"no adapter variant {name!r}; the variants are {', '.join(VARIANT_NAMES)}")
    return importlib.import_module(f"{__name__}.{name}").VARIANT
