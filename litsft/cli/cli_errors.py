"""What the CLI says when jsonargparse refuses a command line whose cause it reports badly: an unknown
option or config key (named with its close matches, or with the command that has it, not as jsonargparse's
`NestedArg(...)` or union errors), a YAML syntax error in a --config file (named with its file and line),
and a bad value (named with its option, `--data.prompt_style`, not the `--data` that holds it).

Only called after parsing failed, so a good command line pays nothing for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Keys jsonargparse adds to every parser, and the keys under a subclass option that are not its fields.
PARSER_KEYS = frozenset({"help", "config", "print_config"})
SUBCLASS_KEYS = frozenset({"class_path", "init_args", "help"})

Config = tuple[Path, Any]
"""A --config file and its parsed content."""


def explain_parse_error(make_parser: Callable[[], Any], argv: list[str]) -> str | None:
    """One line for the first --config file that is not valid YAML, or the first unknown option or config
    key in argv; None when neither explains the failure."""
    import yaml

    configs: list[Config] = []
    for value in _config_paths(argv):
        path = Path(value)
        try:
            configs.append((path, yaml.safe_load(path.read_text())))
        except OSError:
            continue  # a missing file (jsonargparse's own message names it) or an inline YAML string
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            return f"--config {path}{where}: {problem}; fix the YAML syntax there"
    options = Options(make_parser(), argv, configs)
    problems: dict[str | None, list[str]] = {}  # every unknown key, by where it was given
    for source, key in _given_keys(argv, configs):
        problem = options.unknown(key, prefix="--" if source is None else "")
        if problem is not None:
            problems.setdefault(source, []).append(problem)
    lines = [
        ("" if source is None else f"{source}: ") + "; and ".join(found) for source, found in problems.items()
    ]
    return "; and ".join(lines) or None


def argument_error_line(message: str) -> str:
    """jsonargparse's multi-line parse error as one line naming the option, the value and the choices. A bad
    value of a data module's option (`--data.prompt_style vicuna`) is reported by jsonargparse under the
    option that holds the module (`data`), with the option's own error nested inside: name the inner one."""
    lines = [line.strip().lstrip("- ").strip() for line in message.splitlines() if line.strip()]
    key = re.match(r'Parser key "([^"]+)":?\s*(.*)', lines[0]) if lines else None
    if key is None:
        return " ".join(lines)
    option, text = f"--{key.group(1)}", "\n".join([key.group(2), *lines[1:]])
    nested = re.search(r"NestedArg\(key='([^']+)', val=", text)
    inner = nested and re.search(rf'Parser key "{re.escape(nested.group(1))}":?\s*', text)
    if inner:
        option, text = f"{option}.{nested.group(1)}", text[inner.end() :]
    given = re.search(r"(?:Got|Given) value: (.*)", text)
    value = given.group(1) if given else None
    literal = re.search(r"typing\.Literal\[(.*?)\]", text)
    if literal and value is not None:
        return f"{option}={value} is not one of {literal.group(1)}"
    typed = re.search(r"Expected a <class '(int|float|bool)'>", text)
    if typed and value is not None:
        return f"{option}={value} is not a valid {typed.group(1)}"
    subtypes = re.search(r"Subtypes: \[(.*?)\]", text)
    if subtypes and value is not None:
        choices = _subclass_names(re.findall(r"<class '([\w.]+)'>", subtypes.group(1)))
        if choices:
            return f"{option}={value} is not one of {', '.join(choices)}"
    first = next((line for line in text.splitlines() if line), "invalid value")
    return f"{option}: {first}" + (f" (got {value})" if value is not None else "")


def _subclass_names(class_paths: list[str]) -> list[str]:
    """Names of the concrete classes that can fill a parameter typed as one of these classes."""
    names: list[str] = []
    for path in class_paths:
        module_name, _, class_name = path.rpartition(".")
        cls = getattr(sys.modules.get(module_name), class_name, None)
        stack = list(cls.__subclasses__()) if isinstance(cls, type) else []
        while stack:
            sub = stack.pop(0)
            if not sub.__subclasses__() and sub.__name__ not in names:
                names.append(sub.__name__)
            stack.extend(sub.__subclasses__())
    return names


def bare_subclass_help(argv: list[str]) -> str | None:
    """The option (`data`) of a `--data.help` given without a class name, for which jsonargparse would
    print an empty help."""
    for i, arg in enumerate(argv):
        if (
            arg.startswith("--")
            and arg.endswith(".help")
            and (i + 1 == len(argv) or argv[i + 1].startswith("-"))
        ):
            return arg[2:].removesuffix(".help")
    return None


def list_subclasses(make_parser: Callable[[], Any], group: str) -> str | None:
    """The classes that can fill option `group`, one a line with the first paragraph of its docstring; None
    when `group` takes no class."""
    classes = Options(make_parser(), [], []).subclasses.get(group, [])
    if not classes:
        return None
    lines = [f"--{group} takes one of these (--{group}.help NAME lists its options):"]
    for cls in classes:
        summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        lines.append(f"  {cls.__name__:<12} {summary}")
    return "\n".join(lines)


class Options:
    """The keys a command accepts, from the parser jsonargparse builds for it: its options, and for an
    option typed by a base class (`--data`), the fields of the subclass chosen (or of all of them)."""

    def __init__(self, parser: Any, argv: list[str], configs: list[Config]) -> None:
        self.keys = {action.dest for action in parser._actions if action.dest} - {"help"}
        self.subclasses: dict[str, list[type]] = {}
        for action in parser._actions:
            classes = _leaf_subclasses(getattr(action, "_typehint", None))
            if classes:
                self.subclasses[action.dest] = classes
        self.chosen = {group: _chosen_class(group, classes, argv, configs)
                       for group, classes in self.subclasses.items()}  # fmt: skip

    def unknown(self, key: str, prefix: str = "--") -> str | None:
        """None when the command accepts `key` (dotted), else the line that says it does not; keys are
        written with `prefix` ("--" for command-line options, "" for config keys)."""
        group, _, field = key.partition(".")
        if group in self.subclasses and field:
            field = field.removeprefix("init_args.")
            chosen = self.chosen[group]
            classes = [chosen] if chosen is not None else self.subclasses[group]
            fields = sorted({name for cls in classes for name in _init_names(cls)})
            if field in fields or field in SUBCLASS_KEYS:
                return None
            which = f" of --{group} {chosen.__name__}" if chosen is not None else ""
            listed = (
                f"--{group}.help {chosen.__name__ if chosen is not None else '<class>'} lists its options"
            )
            matches = [f"{group}.{match}" for match in _matches(field, fields)]
            return _unknown_line(prefix, f"{group}.{field}", matches, which, listed)
        if key in self.keys or key in PARSER_KEYS or (key.endswith("+") and key[:-1] in self.keys):
            return None
        # Close matches among the options of the same group (train.*, ...), or the top-level ones.
        siblings = [name.removeprefix(f"{group}.") for name in self.keys if name.startswith(f"{group}.")]
        if field and siblings:
            matches = [f"{group}.{match}" for match in _matches(field, sorted(siblings))]
        else:
            matches = _matches(key, sorted(self.keys))
        if not matches:  # the name in another group (`--lr`), or another tool's name for it
            name = key.rpartition(".")[2]
            name = OTHER_TOOLS_NAMES.get(name, name)
            matches = sorted(option for option in self.keys if option.rpartition(".")[2] == name)
        # Only for a command without the group: finetune_lora's own --lora.* must not send users to itself.
        if not matches and group in OTHER_COMMANDS_OPTIONS and not siblings:
            return f"unknown {'option' if prefix else 'key'} {prefix}{key}; {OTHER_COMMANDS_OPTIONS[group]}"
        return _unknown_line(prefix, key, matches, "")


# Options of one training command given to another: what the user wants is the other command.
OTHER_COMMANDS_OPTIONS = {
    "quantize": (
        "QLoRA (an NF4 base with adapters trained over it) is `litsft finetune_lora --quantize nf4`; "
        "finetune_full and pretrain train every weight, which cannot stay 4-bit"
    ),
    "lora": "LoRA adapters are trained by `litsft finetune_lora` (with --lora.*)",
}


# Hugging Face TrainingArguments' names (https://huggingface.co/docs/transformers/main_classes/trainer), and
# PEFT's, of options litsft names otherwise.
OTHER_TOOLS_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "output_dir": "out_dir",
    "max_grad_norm": "max_norm",
    "warmup_ratio": "warmup_fraction",
    "lr_scheduler_type": "schedule",
    "adam_epsilon": "eps",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "gradient_checkpointing": "activation_checkpointing",
    "logging_steps": "log_interval",
    "save_steps": "save_interval",
    "eval_steps": "interval",
    "save_total_limit": "keep_last",
    "resume_from_checkpoint": "resume",
    "model_name_or_path": "checkpoint_dir",
    # PEFT's LoraConfig (https://huggingface.co/docs/peft/package_reference/lora) names for --lora.*.
    "r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "targets",
}


def _matches(name: str, known: list[str]) -> list[str]:
    """Up to three of `known` that `name` may have meant: another tool's name for one, close spellings, or
    (when none is close) those that begin with the same word (`train_dir`: `train_data_path`)."""
    name = OTHER_TOOLS_NAMES.get(name, name)
    if name in known:
        return [name]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.7)
    first_word = name.split("_")[0] + "_"
    return close or [option for option in known if "_" in name and option.startswith(first_word)][:3]


def _unknown_line(
    prefix: str, name: str, matches: list[str], which: str, listed: str = "--help lists every option"
) -> str:
    close = [f"{prefix}{match}" for match in matches]
    hint = f"did you mean {' or '.join(close)}?" if close else listed
    kind = "option" if prefix.startswith("--") else "key"
    return f"unknown {kind} {prefix}{name}{which}; {hint}"


def _config_paths(argv: list[str]) -> Iterator[str]:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            yield argv[i + 1]
        elif arg.startswith("--config="):
            yield arg.partition("=")[2]


def _given_keys(argv: list[str], configs: list[Config]) -> Iterator[tuple[str | None, str]]:
    """(where, dotted key) of everything argv sets: "--config <file>" for keys from a config file, None
    for options on the command line."""
    contents = {str(path): content for path, content in configs}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        key, _, value = arg[2:].partition("=")
        if key != "config":
            yield None, key
            continue
        path = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if isinstance(contents.get(path), dict):
            for config_key in _flatten(contents[path]):
                yield f"--config {path}", config_key


def _flatten(mapping: dict, prefix: str = "") -> Iterator[str]:
    """Dotted keys of a config; a data-module choice written {class_path, init_args} is kept as one."""
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key != "init_args":
            yield from _flatten(value, f"{dotted}.")
        elif isinstance(value, dict):
            yield from _flatten(value, prefix)
        else:
            yield dotted


def _leaf_subclasses(typehint: Any) -> list[type]:
    """The concrete classes that can fill an option typed by a base class (or a Union with one)."""
    candidates = [typehint, *getattr(typehint, "__args__", ())]
    leaves: list[type] = []
    for base in candidates:
        if not isinstance(base, type) or base is type(None) or not base.__subclasses__():
            continue
        stack = list(base.__subclasses__())
        while stack:
            sub = stack.pop(0)
            if not sub.__subclasses__() and sub not in leaves:
                leaves.append(sub)
            stack.extend(sub.__subclasses__())
    return leaves


def _chosen_class(group: str, classes: list[type], argv: list[str], configs: list[Config]) -> type | None:
    """The subclass named by `--group Name` (last one wins), or by `group: Name` / `class_path` in a config."""
    names: list[Any] = []
    for _, content in configs:
        value = content.get(group) if isinstance(content, dict) else None
        names.append(value.get("class_path") if isinstance(value, dict) else value)
    for i, arg in enumerate(argv):
        if arg == f"--{group}" and i + 1 < len(argv):
            names.append(argv[i + 1])
        elif arg.startswith(f"--{group}="):
            names.append(arg.partition("=")[2])
    # "JSON", "litsft.data.JSON" (as --print_config writes it) or the defining module's path.
    by_name = {cls.__name__: cls for cls in classes}
    chosen = [by_name[name.rpartition(".")[2]] for name in names
              if isinstance(name, str) and name.rpartition(".")[2] in by_name]  # fmt: skip
    return chosen[-1] if chosen else None


def _init_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls) if field.init]
    return [name for name in inspect.signature(cls).parameters if name not in ("self", "args", "kwargs")]
