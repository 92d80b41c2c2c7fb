"""`litsft download`: a model from the Hugging Face Hub (or the mirror that HF_ENDPOINT names), converted into a
litsft checkpoint in checkpoints/<org>/<name>.

Only what litsft reads is fetched: config.json, the tokenizer files, generation_config.json and the
safetensors weights. Pickle weights (pytorch_model*.bin) only when asked for with --allow_pickle_weights, and
even then they are read with torch.load(weights_only=True), which rebuilds tensors and refuses every other
Python object, so a hostile file cannot run code. `.pth` files (Meta's original layout) are never fetched.

Files go through huggingface_hub into its cache (HF_HOME, shared with transformers): a dropped connection
resumes the file with an HTTP range request, and a killed download keeps the files it finished, so running
the same command again fetches only what is missing. The conversion streams one tensor at a time and
publishes the checkpoint with one rename, so a directory holding litsft_config.json is a complete checkpoint.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from litsft.errors import LitsftError
from litsft.model.config import CONFIG_FILENAME, DType
from litsft.runtime.files import read_json

SOURCE_FILENAME = "hub_source.json"
"""Written into a downloaded checkpoint: the repo id, the revision asked for and the commit it resolved to."""
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# Top-level names only (a literal prefix never matches a file in a subfolder such as original/).
SAFETENSORS_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
PICKLE_PATTERNS = ("pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
PICKLE_FLAG = "--allow_pickle_weights true"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def download(
    repo_id: str,
    out_dir: Path | None = None,
    revision: str | None = None,
    access_token: str | None = None,
    allow_pickle_weights: bool = False,
    dtype: DType = "auto",
) -> None:
    """Download a model from the Hugging Face Hub and convert it into a litsft checkpoint.

    Args:
        repo_id: The model's hub id, <org>/<name>, e.g. meta-llama/Llama-3.2-1B.
        out_dir: Where the litsft checkpoint goes; default checkpoints/<org>/<name>. A complete checkpoint
            already there is kept and nothing is downloaded.
        revision: A branch, tag or commit of the repository; default its main branch.
        access_token: A Hugging Face token, for gated or private models; default the HF_TOKEN environment
            variable (or the token `hf auth login` stored).
        allow_pickle_weights: Fetch pytorch_model*.bin weights when the repository has no safetensors. They
            are read with torch.load(weights_only=True): tensors only, never arbitrary Python objects.
        dtype: Store the weights in this dtype; "auto" keeps the dtype they have.
    """
    download_checkpoint(repo_id, out_dir, revision, access_token, allow_pickle_weights, dtype)


def is_repo_id(value: str) -> bool:
    """Whether `value` has the form of a hub model id, <org>/<name>."""
    return bool(_REPO_ID.fullmatch(value)) and ".." not in value and "--" not in value


def default_checkpoint_dir(repo_id: str) -> Path:
    return Path("checkpoints") / repo_id


def is_converted(checkpoint_dir: Path) -> bool:
    """A converted checkpoint is published with one rename, so its config file means it is complete."""
    return (Path(checkpoint_dir) / CONFIG_FILENAME).is_file()


def download_checkpoint(
    repo_id: str,
    out_dir: Path | None = None,
    revision: str | None = None,
    token: str | None = None,
    allow_pickle_weights: bool = False,
    dtype: DType = "auto",
) -> Path:
    """The litsft checkpoint of a hub model: the one already in `out_dir`, or downloaded and converted there."""
    if not is_repo_id(repo_id):
        raise LitsftError(
            f"{repo_id!r} is not a Hugging Face model id; pass <org>/<name>, e.g. meta-llama/Llama-3.2-1B"
        )
    out_dir = Path(out_dir) if out_dir is not None else default_checkpoint_dir(repo_id)
    if is_converted(out_dir):
        _check_same_source(out_dir, repo_id, revision)
        print(f"{out_dir} already holds {repo_id}; nothing to download", file=sys.stderr, flush=True)
        return out_dir
    snapshot, commit = fetch_snapshot(repo_id, revision, token, allow_pickle_weights)
    source = {"repo_id": repo_id, "revision": revision or "main", "commit": commit}
    from litsft.huggingface.convert import (
        convert_hf_directory,  # torch: only once there is something to convert
    )

    convert_hf_directory(
        snapshot, out_dir, name=repo_id, dtype=dtype, extra_files={SOURCE_FILENAME: json.dumps(source) + "\n"}
    )
    print(
        f"Downloaded {repo_id} ({commit[:12]}) and saved the litsft checkpoint to {out_dir}", file=sys.stderr
    )
    return out_dir


def _check_same_source(out_dir: Path, repo_id: str, revision: str | None) -> None:
    path = out_dir / SOURCE_FILENAME
    if revision is None or not path.is_file():
        return
    source = read_json(path)
    if source.get("repo_id") != repo_id or revision not in (source.get("revision"), source.get("commit")):
        raise LitsftError(
            f"{out_dir} already holds {source.get('repo_id')} at revision {source.get('revision')}, not "
            f"{repo_id} at {revision}; pass another --out_dir"
        )


def fetch_snapshot(
    repo_id: str, revision: str | None, token: str | None, allow_pickle_weights: bool
) -> tuple[Path, str]:
    """(local directory holding the files litsft needs, commit) of a hub repository, through the HF cache."""
    from huggingface_hub import HfApi, constants, snapshot_download

    offline = constants.is_offline_mode()
    patterns = [*METADATA_FILES, *SAFETENSORS_PATTERNS, *(PICKLE_PATTERNS if allow_pickle_weights else ())]
    try:
        if not offline:
            info = HfApi(token=token).model_info(repo_id, revision=revision)
            files = [sibling.rfilename for sibling in info.siblings or []]
            patterns = _files_to_fetch(repo_id, files, allow_pickle_weights)
        snapshot = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, token=token or None)
        )
    except Exception as err:
        raise _hub_error(err, repo_id, revision, offline) from None
    return snapshot, snapshot.name


def _files_to_fetch(repo_id: str, files: list[str], allow_pickle_weights: bool) -> list[str]:
    """The repository's files litsft reads: metadata, tokenizer, and one set of weights (safetensors first)."""
    from fnmatch import fnmatch

    def matching(patterns: tuple[str, ...]) -> list[str]:
        return [name for name in files if any(fnmatch(name, pattern) for pattern in patterns)]

    metadata = [name for name in files if name in METADATA_FILES]
    if "config.json" not in metadata:
        raise LitsftError(f"{repo_id} has no config.json; it is not a transformers model repository")
    weights = matching(SAFETENSORS_PATTERNS)
    if not weights:
        pickled = matching(PICKLE_PATTERNS)
        if pickled and not allow_pickle_weights:
            raise LitsftError(
                f"{repo_id} has only pickle weights ({', '.join(pickled)}), which litsft does not fetch by "
                f"default; pass {PICKLE_FLAG} to fetch them (read as tensors only, with "
                "torch.load(weights_only=True))"
            )
        weights = pickled
    if not weights:
        raise LitsftError(
            f"{repo_id} has no weights litsft reads (model*.safetensors or pytorch_model*.bin at the top level)"
        )
    return metadata + weights


def _hub_error(err: Exception, repo_id: str, revision: str | None, offline: bool) -> Exception:
    """One line for what went wrong talking to the hub, naming the fix."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, LitsftError):
        return err
    if isinstance(err, GatedRepoError):
        return LitsftError(
            f"{repo_id} is a gated model: accept its license on its model page, then set HF_TOKEN to a token "
            "of that account (or pass --access_token)"
        )
    if isinstance(err, RepositoryNotFoundError):
        return LitsftError(
            f"{repo_id} is not a local directory and {constants.ENDPOINT} has no model repository {repo_id} "
            "(or it is private: set HF_TOKEN); check the name"
        )
    if isinstance(err, RevisionNotFoundError):
        return LitsftError(f"{repo_id} has no revision {revision!r}; pass an existing branch, tag or commit")
    if offline and isinstance(err, LocalEntryNotFoundError):
        return LitsftError(
            f"HF_HUB_OFFLINE is set and {repo_id} was never downloaded here; run `litsft download {repo_id}` "
            "on a machine that reaches the hub (and copy checkpoints/ here), or unset HF_HUB_OFFLINE"
        )
    if isinstance(err, HfHubHTTPError):
        return LitsftError(f"the hub refused {repo_id}: {_first_line(err)}")
    if isinstance(err, LocalEntryNotFoundError) or type(err).__module__.startswith("httpx"):
        return LitsftError(
            f"cannot reach {constants.ENDPOINT} to download {repo_id} ({_first_line(err)}); check the network "
            "(HF_ENDPOINT names a mirror) and run the same command again: finished files are kept"
        )
    if isinstance(err, OSError):
        return LitsftError(f"downloading {repo_id} failed: {_first_line(err)}; run the same command again")
    return err


def _first_line(err: Any) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
