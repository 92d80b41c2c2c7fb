"""After run.sh's install step: what the run needs imports, from where it should (python check_install.py SITE).

torch must be the image's own, never one from SITE; litsft, jsonargparse, torchao and pytest must import, and
transformers' model classes (every later step needs them; a model class imports accelerate, which imports the
carried boto3); litdata and datasets are reported but not required (only --data LitData and --data HFDataset
import them, and no step of the run does). Exits 1 with the reason when a requirement fails.
"""

from __future__ import annotations

import importlib
import sys

REQUIRED = ("torch", "litsft", "jsonargparse", "torchao", "pytest", "transformers:LlamaForCausalLM")
"""Modules, or module:attribute where the attribute is imported lazily."""
REPORTED = ("litdata", "datasets")


def main(site: str) -> int:
    failed = False
    for entry in (*REQUIRED, *REPORTED):
        name, _, attribute = entry.partition(":")
        try:
            module = importlib.import_module(name)
            if attribute:
                getattr(module, attribute)
        except Exception as error:  # a missing dependency of a carried package, a broken wheel
            print(f"{name}: does not import: {type(error).__name__}: {error}")
            failed |= entry in REQUIRED
            continue
        where = getattr(module, "__file__", "") or ""
        print(f"{name} {getattr(module, '__version__', '')} from {where}")
        if name == "torch" and where.startswith(site):
            print("torch comes from the carried wheels: the image's own must be used; remove it from .whl")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
