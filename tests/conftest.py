"""Test-run ordering: the longest files first.

pytest-xdist (`-n 4 --dist loadfile`) hands test files to its workers in collection order. The demo test alone
runs the whole main job (minutes); collected in alphabetical order it started near the end and became the tail
of the run while the other workers sat idle. Starting the long files first lets the short ones fill in around them.
xdist's loadfile scheduler would otherwise re-sort the files by how many tests each holds (most first), which puts
the one-test demo file last again; `--no-loadscope-reorder` is set here so the README's command needs no extra flag.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "test_cli_demo.py",
    "test_fault_injection.py",
    "test_docs.py",
    "test_training_engine.py",
    "test_reliability.py",
    "test_checkpoint_hub.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # present when pytest-xdist is installed
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, is unchanged
