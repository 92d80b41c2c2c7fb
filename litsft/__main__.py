"""The `litsft` command: one subcommand per entry point, each a plain function whose signature is its CLI."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from litsft.errors import LitsftError

# Subcommand -> "module:function". Imported only when chosen, so `litsft --help` stays fast.
COMMANDS: dict[str, str] = {
    "finetune_full": "litsft.recipes.finetune_full:setup",
    "finetune_lora": "litsft.recipes.finetune_lora:setup",
    "pretrain": "litsft.recipes.pretrain:setup",
    "convert_from_hf": "litsft.convert:convert_from_hf",
    "convert_to_hf": "litsft.convert:convert_to_hf",
    "merge_lora": "litsft.lora:merge_lora",
    "generate": "litsft.generate:generate",
    "prepare": "litsft.data.prepare:prepare",
    "plan": "litsft.plan:plan",
    "list_models": "litsft.config:list_models",
    "demo": "litsft.demo:demo",
}


def _load(target: str) -> Callable[..., Any]:
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def _usage() -> str:
    lines = [
        "usage: litsft <command> [options]   (litsft <command> --help for a command's options)",
        "",
        "commands:",
    ]
    for name, target in COMMANDS.items():
        try:
            doc = (_load(target).__doc__ or "").strip().splitlines()
        except (ImportError, AttributeError):
            continue
        lines.append(f"  {name:<16} {doc[0] if doc else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    command, *rest = argv
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)
    try:
        function = _load(COMMANDS[command])
        CLI(function, args=rest, prog=f"litsft {command}", as_positional=True)
    except LitsftError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
