"""Test-run ordering (the longest files first), and the fixtures many test files share.

pytest-xdist (`-n 4 --dist loadfile`) hands test files to its workers in collection order. The demo test alone
runs the whole main job (minutes); collected in alphabetical order it started near the end and became the tail
of the run while the other workers sat idle. Starting the long files first lets the short ones fill in around them.
xdist's loadfile scheduler would otherwise re-sort the files by how many tests each holds (most first), which puts
the one-test demo file last again; `--no-loadscope-reorder` is set here so the README's command needs no extra flag.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from tiny_tokenizer import write_tiny_tokenizer

from litsft.data.tokenizer import Tokenizer

LONGEST_FIRST = (
    "test_cli_demo.py",
    "test_fault_injection.py",
    "test_docs.py",
    "test_training_engine.py",
    "test_reliability.py",
    "test_huggingface_hub.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # present when pytest-xdist is installed
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, is unchanged


@pytest.fixture(autouse=True)
def logs_to_a_live_stream() -> None:
    """Lightning and torchmetrics give their loggers a handler bound to the sys.stderr of the moment they are
    first imported. Imported during a test that captures output (capsys), that stream is closed when the test
    ends, and a later test's log line ("Seed set to ...") prints "--- Logging error ---" and a traceback into
    that test's output. Before each test such a handler is pointed at the stream of the moment."""
    for logger in list(logging.Logger.manager.loggerDict.values()):
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one first


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer with the ChatML template, one per test file (a file may define its own)."""
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(directory, chat_template="chatml")
    return Tokenizer(directory)


@pytest.fixture
def fresh_cli_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the CLI in this process as if fresh: its own cache and cwd, no launcher's rank variables, and
    pytest's signal handlers back afterwards (launch installs the preemption handlers)."""
    import torch  # here, not at the top: most test files never need this fixture

    from litsft.runtime.preemption import PreemptionFlag

    monkeypatch.setenv("LITSFT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    yield
    PreemptionFlag.uninstall()
