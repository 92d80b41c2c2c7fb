"""The `litsft` command: one subcommand per entry point, each a plain function whose signature is its CLI.

Every error a user can cause ends the same way: one `error: ...` line on stderr, exit status 2, no
traceback. A training run stopped by SIGTERM/SIGUSR1 exits with status 124 after writing a checkpoint
(`litsft.runtime.preemption.PREEMPTED_EXIT_CODE`): relaunch the same command to resume.
"""

from __future__ import annotations

import ast
import atexit
import difflib
import importlib
import importlib.util
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any, NoReturn

from litsft.errors import LitsftError
from litsft.runtime import timings  # noqa: F401  (its clock starts when it is imported: here, at the start)

# Subcommand -> "module:function". Imported only when chosen (most of them import torch), so `litsft --help`
# and `litsft --version` import none of them.
COMMANDS: dict[str, str] = {
    "finetune_full": "litsft.recipes.finetune_full:setup",
    "finetune_lora": "litsft.recipes.finetune_lora:setup",
    "pretrain": "litsft.recipes.pretrain:setup",
    "download": "litsft.huggingface.hub:download",
    "convert_from_hf": "litsft.huggingface.convert:convert_from_hf",
    "convert_to_hf": "litsft.huggingface.convert:convert_to_hf",
    "merge_lora": "litsft.huggingface.convert:merge_lora",
    "generate": "litsft.inference.generate:generate",
    "chat": "litsft.inference.chat:chat",
    "evaluate": "litsft.inference.evaluate:evaluate",
    "prepare": "litsft.data.prepare:prepare",
    "prepare_sft": "litsft.data.prepare:prepare_sft",
    "plan": "litsft.training.plan:plan",
    "list_models": "litsft.model.accounting.sizes:list_models",
    "demo": "litsft.cli.demo:demo",
}
USAGE_ERROR_EXIT_CODE = 2


def _load(target: str) -> Callable[..., Any]:
    module_name, function_name = target.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def _usage() -> str:
    lines = [
        "usage: litsft <command> [options]   (litsft <command> --help for a command's options)",
        "       litsft --version",
        "",
        "commands:",
    ]
    for name, target in COMMANDS.items():
        lines.append(f"  {name:<16} {_summary(target)}")
    return "\n".join(lines)


def _summary(target: str) -> str:
    """The first line of a command function's docstring, read from its source file without importing it."""
    module_name, function_name = target.split(":")
    # The module's file is looked up in its package's folders: find_spec(module) would import the
    # package (litsft.data imports numpy, tokenizers, jinja2).
    package, _, leaf = module_name.rpartition(".")
    folders = importlib.util.find_spec(package).submodule_search_locations or []
    source = next(path for folder in folders if (path := Path(folder) / f"{leaf}.py").is_file())
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function_name:
            doc = (ast.get_docstring(node) or "").strip().splitlines()
            return doc[0] if doc else ""
    return ""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    if argv[0] == "--version":
        print(f"litsft {version('litsft')}")
        return
    from jsonargparse import CLI, ArgumentError, set_parsing_settings

    # The attribute docstrings of the config dataclasses (train.*, optimizer.*, ...) become --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    command, *rest = argv
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        fail(
            f"unknown command {command!r}; "
            + (f"did you mean {close[0]}?" if close else f"choose one of: {', '.join(COMMANDS)}")
        )
    from litsft.cli.cli_errors import bare_subclass_help, list_subclasses

    try:
        function = _load(COMMANDS[command])
        # exit_on_error=False: parse errors come back as exceptions, to be printed on one line.
        # allow_abbrev=False: a misspelled option is an error, not silently expanded.
        cli = partial(
            CLI,
            function,
            prog=f"litsft {command}",
            as_positional=True,
            exit_on_error=False,
            allow_abbrev=False,
        )
        group = bare_subclass_help(rest)
        if group is not None:  # `--data.help` without a class: jsonargparse would print an empty help
            from jsonargparse import capture_parser

            listed = list_subclasses(lambda: capture_parser(partial(cli, args=[])), group)
            if listed is not None:
                print(listed)
                return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="jsonargparse")
            cli(args=rest)
    except ArgumentError as err:
        from jsonargparse import capture_parser

        from litsft.cli.cli_errors import argument_error_line, explain_parse_error

        explained = explain_parse_error(lambda: capture_parser(partial(cli, args=[])), rest)
        fail(explained or argument_error_line(str(err)))
    except (LitsftError, OSError) as err:
        fail(str(err))
    except ValueError as err:
        # jsonargparse wraps what a data module's __post_init__ raises while it tries each subclass.
        cause = user_error_behind(err)
        if cause is None:
            raise
        fail(str(cause))


def user_error_behind(err: BaseException) -> LitsftError | None:
    """The LitsftError an exception was raised from, if any."""
    while err is not None and not isinstance(err, LitsftError):
        err = err.__cause__ or err.__context__
    return err


def fail(message: str) -> NoReturn:
    from litsft.runtime.processes import is_spawned_rank

    if is_spawned_rank():
        # A rank spawned by Fabric's launcher usually fails with the launcher, which kills it at once and
        # reports the error itself: waiting first keeps the report to one line. A failure of this rank
        # alone is still printed.
        time.sleep(3)
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR_EXIT_CODE)


def run() -> None:
    """The console entry point: `main`, then `leave`, once the command has finished or a training run stopped
    by a signal has published its checkpoint (SystemExit with PREEMPTED_EXIT_CODE, or 0 on a rank whose stop
    the launcher reports)."""
    try:
        main()
    except SystemExit as stop:
        from litsft.runtime.preemption import PREEMPTED_EXIT_CODE

        if stop.code in (None, 0, PREEMPTED_EXIT_CODE):
            # A stop spends the grace period a scheduler gives before SIGKILL: from SIGTERM to exit, 2
            # processes on a 2-core CPU took 2.2-2.5 s with Python's own shutdown and 0.21-0.25 s this way
            # (step and checkpoint included). That shutdown also once ended a rank in std::terminate
            # ("terminate called without an active exception": a C++ thread still joinable when static
            # objects are destroyed; 1 of about 70 stops).
            leave(stop.code or 0)
        raise
    leave()


def leave(code: int = 0) -> NoReturn:
    """End the process with status `code` the way Python would, less its module teardown.

    Once torch and Lightning are imported, Python's own shutdown clears thousands of modules after the work
    is done: 2.2-4.1 s on a busy 2-core machine (load average 15-25), 0.1 s this way. Everything a user can see
    still happens first: non-daemon threads are joined and the atexit handlers run (loggers, multiprocessing,
    logging), as Python does, then the standard streams are flushed. Only the success path and a stop with
    its checkpoint leave this way; errors exit as before.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
