"""Training data: one interface (DataModule) and its modules, selected on the command line with
`--data JSON`, `--data HFDataset`, `--data Demo`, `--data TextFiles` or `--data LitData`.

The CLI imports these modules to parse `--data` (and `--help`), so importing them imports no torch: the
loaders import it when they are built.
"""

from litsft.data.base import DataModule, Loader, SFTDataModule
from litsft.data.chat import PROMPT_STYLES, ChatFormat, PromptStyle
from litsft.data.demo import Demo, build_demo_tokenizer, exact_match, write_demo_corpus
from litsft.data.hf_dataset import HFDataset
from litsft.data.json_data import JSON
from litsft.data.text import LitData, TextFiles

__all__ = [
    "JSON",
    "PROMPT_STYLES",
    "ChatFormat",
    "DataModule",
    "Demo",
    "HFDataset",
    "LitData",
    "Loader",
    "PromptStyle",
    "SFTDataModule",
    "TextFiles",
    "build_demo_tokenizer",
    "exact_match",
    "write_demo_corpus",
]
