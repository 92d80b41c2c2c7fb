"""Model families: one module per family owns what differs (its config.json translation, weight names,
block variant and named configs) and registers a `Family`; the rest of litsft looks families up here and
never names one. Adding a family: a module beside these, imported below."""

from litsft.families import llama, mistral, qwen2, qwen3  # noqa: F401  (each registers its family)
from litsft.families.spec import (
    FAMILIES,
    Family,
    WeightMap,
    family_of,
    family_of_hf_config,
    register_family,
)

__all__ = ["FAMILIES", "Family", "WeightMap", "family_of", "family_of_hf_config", "register_family"]
