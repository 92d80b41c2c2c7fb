"""Tensors sharded across ranks in any placement (FSDP2's dim-0 shards, a `Shard(1)` expert weight,
replicas), saved as each rank's parts or merged into whole tensors, and loaded, through
torch.distributed.checkpoint (DCP) with its Hugging Face safetensors storage; and the rank helpers that
saving and loading collectively need.

DCP writes each rank's pieces to its own safetensors file with their offsets in the file's header
(`HuggingFaceStorageWriter(save_distributed=True)`), writes a replicated tensor once, and reads any
placement back from any number of ranks (`HuggingFaceStorageReader`). Its metadata lives in those headers,
not in DCP's pickled `.metadata` file, which nothing here reads: loading never unpickles.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.futures import Future as TorchFuture

from litsft.errors import LitsftError
from litsft.model.precision.float8 import without_float8_wrapper
from litsft.runtime.files import ChecksummedFile, first_line

# DCP warns on every save and load without a process group, though one process is what litsft means then;
# filtered for good, not around each call: a background save warns from its own thread, later.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def first_message(message: str) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank whose `message` is not empty, the same on every rank; None if every
    rank's is. Collective: how ranks agree on a decision any one of them can veto."""
    messages = [message]
    if world_size() > 1:
        messages = [""] * world_size()
        dist.all_gather_object(messages, message)
    for rank, text in enumerate(messages):
        if text:
            return rank, text
    return None


def dcp_failure(error: CheckpointException) -> BaseException:
    """The exception of the lowest rank whose part of a DCP save or load failed (DCP gathers them all)."""
    failures = error.failures
    if not failures:
        return error
    wrapped = failures[min(failures)]
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds (a mixture of experts' balancing biases), by name: model state
    that is not a parameter, saved and loaded beside the parameters."""
    return {
        name: buffer
        for name, buffer in model.named_buffers()
        if name.rpartition(".")[2]
        not in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
    }


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with float8 all-gather's weight wrapper taken off its local part (torchao's
    WeightWithDynamicFloat8CastTensor, which safetensors cannot write), sharing its storage: what is saved is the
    weight, and what is loaded lands in it. Any other tensor as it is."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        inner = without_float8_wrapper(local)
        if inner is local:
            return tensor
        return DTensor.from_local(
            inner,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return without_float8_wrapper(tensor)


@torch.no_grad()
def copy_local_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor `full` into `target` (a plain tensor or a DTensor of any
    placement), slicing locally: no rank sends anything."""
    target = plain(target)
    if isinstance(target, DTensor):
        part = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def local_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of this rank's parts of `tensors` (plain tensors or DTensors of any placement)."""
    parts = (plain(t).to_local() if isinstance(t, DTensor) else t for t in tensors.values())
    return sum(part.numel() * part.element_size() for part in parts)


# ---- DCP with safetensors storage -------------------------------------------------------------------------
def save_sharded(
    tensors: dict[str, torch.Tensor], directory: Path, checksums: dict[str, str] | None = None
) -> dict[str, str]:
    """Write every rank's part of `tensors` (flat name -> tensor or DTensor) into `directory`, one
    safetensors file per rank that holds a part no other rank writes, fsynced. Collective. Raises the
    OSError (or other exception) of the lowest rank that failed, on every rank.

    Returns on rank 0 the checksum of every file every rank wrote, by its path relative to `directory`'s
    parent, with every rank's `checksums` (of files it wrote itself) among them; on other ranks {}."""
    writer = _CheckpointWriter(str(directory), save_distributed=True)
    writer.local_checksums.update(checksums or {})
    _save(tensors, writer)
    return writer.checksums


def save_consolidated(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    file_index: dict[str, int],
    before_write: Callable[[], None] = lambda: None,
) -> None:
    """Write `tensors` (any placement) whole into `directory`, in the files Hugging Face names shards by
    (`model-0000i-of-0000N.safetensors`, i = `file_index[name]`, and `model.safetensors.index.json`). Every
    rank writes its parts under `directory/sharded/`; rank 0 then merges them a tensor at a time (DCP's
    consolidation), so no rank ever holds the whole set, and removes the parts. Collective."""
    scalars = [name for name, tensor in tensors.items() if tensor.dim() == 0]
    if scalars:  # torch 2.13's consolidation writes a 0-dim tensor as zeros
        raise ValueError(f"cannot consolidate 0-dim tensors: {scalars}")
    writer = _CheckpointWriter(
        str(directory), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=file_index
    )
    writer.before_write = before_write
    _save(tensors, writer)  # returns on every rank once rank 0 has consolidated
    if global_rank() == 0:
        shutil.rmtree(writer.path)


def _save(tensors: dict[str, torch.Tensor], writer: HuggingFaceStorageWriter) -> None:
    try:
        dcp.save(
            {name: plain(tensor) for name, tensor in tensors.items()},
            storage_writer=writer,
            no_dist=world_size() == 1,
        )
    except CheckpointException as err:
        raise dcp_failure(err) from None


def save_sharded_in_background(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    process_group: dist.ProcessGroup | None,
    before_write: Callable[[], None] = lambda: None,
    stager: AsyncStager | None = None,
    checksums: dict[str, str] | None = None,
) -> Future:
    """`save_sharded`, returning as soon as this rank's part is copied to host memory: the files are written
    by a thread while training goes on. The future ends once every rank's files are on disk, with
    `save_sharded`'s checksums, or raises the lowest failing rank's exception on every rank.
    `process_group`: a gloo group used for nothing else (the write's collectives must not interleave with
    training's); `before_write` runs in that thread first; `stager` makes the host copy (`pinned_stager`;
    by default a new copy in ordinary memory, freed once written). Collective."""
    writer = _CheckpointWriter(str(directory), save_distributed=True)
    writer.before_write = before_write
    writer.local_checksums.update(checksums or {})
    written = dcp.async_save(
        {name: plain(tensor) for name, tensor in tensors.items()},
        storage_writer=writer,
        process_group=process_group,
        async_stager=stager,
        no_dist=world_size() == 1,
    )
    result: Future = Future()

    def unwrap(done: Future) -> None:
        error = done.exception()
        if error is None:
            result.set_result(writer.checksums)
        else:
            result.set_exception(dcp_failure(error) if isinstance(error, CheckpointException) else error)

    written.add_done_callback(unwrap)
    return result


def pinned_stager() -> AsyncStager:
    """The host copy a background save makes on a GPU: page-locked buffers, allocated by the first save and
    refilled by every later one (DCP's `BlockingAsyncStager` with its cache). A device copies to page-locked
    memory at several times the rate it copies to ordinary, pageable memory, which the driver stages through
    a page-locked buffer of its own (https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html), and
    the buffers are allocated once, not at every save. They hold one copy of this rank's checkpoint while
    the stager lives; a save must be written before the next one refills them (the Checkpointer waits for
    it). CUDA only: page-locking needs the driver. (Not DCP's `DefaultStager`, whose copy of a DTensor fails
    on torch 2.11 with `KeyError: <class 'type'>`.)"""
    return _KeptBuffersStager(cache_staged_state_dict=True)


class _KeptBuffersStager(BlockingAsyncStager):
    def stage(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        cache = self.state_dict_cache
        if cache is not None and cache.keys() != state_dict.keys():
            self.state_dict_cache = None  # another set of tensors (the optimizer gained state): new buffers
        return super().stage(state_dict)

    def close(self) -> None:
        """Drop the buffers and hand their page-locked memory back to the system: torch's host allocator
        keeps freed page-locked blocks for later copies unless its cache is emptied."""
        self.state_dict_cache = None
        if torch.cuda.is_available():
            empty_host_cache()()


def empty_host_cache() -> Callable[[], None]:
    """torch's call that hands the host allocator's cached page-locked blocks back to the system: public as
    `torch.accelerator.empty_host_cache` from torch 2.13, the private `torch._C._host_emptyCache` before
    (torch 2.11, the GPU image's), which CUDA builds of 2.13 still have."""
    public = getattr(torch.accelerator, "empty_host_cache", None)
    return public if public is not None else torch._C._host_emptyCache


_CHECKSUMS = "litsft/checksums"
"""The name of the write result that carries a rank's checksums to rank 0 (no tensor has it)."""


class _CheckpointWriter(HuggingFaceStorageWriter):
    """DCP's Hugging Face safetensors writer, hashing each file as it writes it (no second read) and naming
    the file in a failed write's OSError. Each rank's checksums travel to rank 0 with its write results,
    the way DCP gathers them for `finish` (also from a background save's thread), and are `checksums` there.
    `before_write` runs first in `write_data`."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.before_write: Callable[[], None] = lambda: None
        self.local_checksums: dict[str, str] = {}
        """This rank's files, by path relative to the directory's parent."""
        self.checksums: dict[str, str] = {}
        """Every rank's, on rank 0 once the save is done."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.before_write()
        written = super().write_data(plan, planner)
        written.wait()  # the files are written by now: FileSystemWriter writes before it returns
        for path, checksum in self.fs.written.items():
            self.local_checksums[str(Path(path).relative_to(Path(self.path).parent))] = checksum
        carrier = WriteResult(MetadataIndex(_CHECKSUMS), 0, dict(self.local_checksums))
        results: TorchFuture = TorchFuture()
        results.set_result([*written.value(), carrier])
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == _CHECKSUMS:
                    self.checksums.update(result.storage_data)
        tensors_only = [[r for r in rank_results if r.index.fqn != _CHECKSUMS] for rank_results in results]
        return super().finish(metadata, tensors_only)


class _ChecksummingFileSystem(FileSystem):
    def __init__(self) -> None:
        self.written: dict[str, str] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with ChecksummedFile(Path(path)) as stream:
            yield stream
        self.written[str(path)] = stream.checksum()


class ShardedReader:
    """The tensors DCP stored in a directory of safetensors files, read from the files' headers once.

    `stored()` says what is there (name -> shape, dtype); `load` fills tensors of any placement with their
    parts, each rank reading only the slices it holds. A file whose header cannot be read is a LitsftError
    naming it and `fix`."""

    def __init__(self, directory: Path, fix: str) -> None:
        self.directory, self.fix = Path(directory), fix
        for path in sorted(self.directory.glob("*.safetensors")):
            try:
                with safe_open(path, framework="pt") as handle:
                    handle.metadata()
            except (SafetensorError, OSError) as err:
                raise LitsftError(f"{path} is damaged ({first_line(err)}); {fix}") from None
        self._reader = _HeaderReader(str(self.directory))
        self.metadata = self._reader.read_metadata()

    def stored(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            name: (tuple(entry.size), entry.properties.dtype)
            for name, entry in self.metadata.state_dict_metadata.items()
        }

    def load(self, targets: dict[str, torch.Tensor], collective: bool = True) -> None:
        """Fill `targets` (flat name -> tensor or DTensor) in place. `collective`: every rank calls this with
        the same names; otherwise each rank reads on its own."""
        stored = self.stored()
        for name, target in targets.items():
            if name not in stored:
                raise LitsftError(f"{self.directory} has no tensor {name!r}; {self.fix}")
            if tuple(target.shape) != stored[name][0]:
                raise LitsftError(
                    f"{name}: {self.directory} holds shape {stored[name][0]} but the model expects "
                    f"{tuple(target.shape)}; the checkpoint does not belong to this model config"
                )
        try:
            dcp.load(
                {name: plain(target) for name, target in targets.items()},
                storage_reader=self._reader,
                no_dist=not collective or world_size() == 1,
            )
        except CheckpointException as err:
            failure = dcp_failure(err)
            raise LitsftError(
                f"cannot read {self.directory} (rank {min(err.failures or [0])}: {first_line(failure)}); {self.fix}"
            ) from None


class _HeaderReader(HuggingFaceStorageReader):
    """The Hugging Face reader, its metadata (parsed from every file's header) read once, not per load."""

    _metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata
