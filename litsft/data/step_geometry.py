"""How an optimizer step's global batch is cut across ranks and micro-batches: computed once, asked by the
launcher, the engine, the memory plan and the loaders (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from litsft.errors import LitsftError


@dataclass(frozen=True)
class StepGeometry:
    """How one optimizer step's global batch is cut: into `world_size` equal shares of `samples_per_rank` rows,
    each trained as `accumulation_steps` micro-batches of `micro_batch_size`. Built once with `of`, which refuses
    sizes that do not divide; the launcher, the engine, the memory plan and the loaders all ask it."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @classmethod
    def of(cls, global_batch_size: int, micro_batch_size: int, world_size: int) -> StepGeometry:
        per_step = micro_batch_size * world_size
        if global_batch_size % per_step:
            raise LitsftError(
                f"--train.global_batch_size={global_batch_size} is not divisible by --train.micro_batch_size="
                f"{micro_batch_size} x {world_size} processes = {per_step}; pick a global batch size that is a "
                f"multiple of {per_step}"
            )
        return cls(global_batch_size, micro_batch_size, world_size)

    @property
    def samples_per_rank(self) -> int:
        """Rows of each global batch one rank trains."""
        return self.global_batch_size // self.world_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.samples_per_rank // self.micro_batch_size
