"""Model families: one module per family owns what differs between families (its own config.json keys both
ways, its weight names, the block variant it needs, its named configs with their sources) and registers a
`Family`; the rest of litsft looks families up by `Config.hf_architecture` and never names one.

Adding a family:
1. A module here, `litsft/model/families/<family>.py`, that builds a `Family` (`litsft.model.families.spec`) and calls
   `register_family`: `config_from_hf` / `hf_from_config` for the config.json keys only it has, and the
   declaration of its keys: `hf_keys_read` (what `config_from_hf` reads) and `hf_keys_ignored` (every other
   key of transformers' config class for the architecture, each with why; start from `spec.DECODER_IGNORED`;
   a key whose other values change the math names the values litsft supports, and conversion refuses the
   rest). Then a `WeightMap` (start from `spec.LLAMA_WEIGHT_NAMES`, or `spec.MOE_WEIGHT_NAMES` for a mixture of
   experts; fused tensors go in `fused`, the hub's per-expert tensors in `experts`), the name of its block
   variant, and its named configs, each with the URL of the config.json it was typed from. Nothing imports it
   by name: the package imports each of its modules, which registers the family.
   Names in a family module say what they hold: the registered `Family` is `<FAMILY>_FAMILY` (`GEMMA2_FAMILY`),
   a dict of `Config` values that named configs share is `<SERIES>_VALUES` (`QWEN3_VALUES`, `GEMMA_BLOCK_VALUES`).
2. If it needs a new block, add it to `litsft.model.network.transformer.BLOCK_VARIANTS`; new per-layer features are `Config`
   fields, off by default.
The engine, the recipes and storage do not change. The tests that are parametrized over every registered
family (tests/test_model_families.py, tests/test_model_accounting_flops.py, tests/test_model_accounting_sizes.py) cover it at once:
among them, its declared keys against transformers' config class (a key it neither reads nor ignores fails);
add its tiny transformers model to tests/tiny_hf.py for the conversion and logits tests.
"""

import importlib
import pkgutil

from litsft.model.families.spec import (
    FAMILIES,
    Family,
    WeightMap,
    family_of,
    family_of_hf_config,
    register_family,
)

# Every module here but spec is a family, and importing it registers it (in name order; a family that builds on
# another imports it first).
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "spec":
        importlib.import_module(f"{__name__}.{_module.name}")


__all__ = ["FAMILIES", "Family", "WeightMap", "family_of", "family_of_hf_config", "register_family"]
