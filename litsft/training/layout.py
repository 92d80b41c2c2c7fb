"""How the ranks of a run divide the work: `ParallelLayout`, the one object that the device meshes, the
memory planner, the data loaders and the training step ask (as torchtitan's `ParallelDims` is), so that no
module interprets the sharding strategy or the context size on its own. No torch: `litsft plan` and the
command-line checks read it without starting anything.

Ranks are numbered node after node. A rank's context group is `context` consecutive ranks, always within one
node (they swap activations around every attention layer), and all the ranks of a group read the same
micro-batch: the data replicas are the groups, `world_size / context` of them. Parameters are sharded over
data and context ranks together (as torchtitan folds its `cp` axis into the FSDP axes), so adding context
ranks shrinks parameter memory as adding data ranks does:

| strategy      | parameters sharded over           | replicated over |
|---------------|-----------------------------------|-----------------|
| FULL_SHARD    | every rank                        | -               |
| SHARD_GRAD_OP | every rank                        | -               |
| HYBRID_SHARD  | the ranks of a node               | the nodes       |
| NO_SHARD      | - (every rank holds all of them)  | every rank      |

The expert axis (`expert`, expert parallelism) splits the ranks of a shard group again, for the MoE experts'
weights only: an expert group is `expert` consecutive ranks of a shard group (so, as far as they can, of one
node: its all-to-alls run every MoE layer, over the fastest links), each owning 1/expert of every layer's
experts, whole; each expert weight is then FSDP-sharded over the shard group's ranks that hold the same
experts (one per expert group, `expert_fsdp_mesh_shape`), as torchtitan's `dp_shard x cp == efsdp x ep`.
Every other parameter is sharded as the table says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from litsft.errors import LitsftError

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]


def divisors(n: int) -> list[int]:
    """The positive divisors of n, in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel layout of a run: `devices` processes on each of `num_nodes` nodes, the model sharded as
    `sharding_strategy` says (with more than one process), each sequence split over `context` ranks.
    Build it with `of`, which refuses what cannot run."""

    devices: int
    num_nodes: int = 1
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    context: int = 1
    expert: int = 1

    @classmethod
    def of(
        cls,
        devices: int,
        num_nodes: int = 1,
        sharding_strategy: ShardingStrategy = "FULL_SHARD",
        context: int = 1,
        expert: int = 1,
    ) -> ParallelLayout:
        """The layout, or one line saying why it cannot be and which sizes would work."""
        if context < 1:
            raise LitsftError(f"--parallel.context={context}: it is a number of ranks, at least 1")
        if devices % context:
            sizes = ", ".join(map(str, divisors(devices)))
            raise LitsftError(
                f"--parallel.context={context} does not divide --devices={devices}: a context group is made of "
                f"ranks of one node; pick one of {sizes}"
            )
        layout = cls(devices, num_nodes, sharding_strategy, context, expert)
        if expert < 1:
            raise LitsftError(f"--parallel.expert={expert}: it is a number of ranks, at least 1")
        if expert > 1 and layout.shard_group_size % expert:
            shard_group = layout.shard_group_size
            sizes = ", ".join(map(str, divisors(shard_group)))
            why = (
                "--fsdp.sharding_strategy NO_SHARD shards nothing; use FULL_SHARD or HYBRID_SHARD"
                if shard_group == 1 and layout.sharded and sharding_strategy == "NO_SHARD"
                else f"pick one of {sizes}"
            )
            raise LitsftError(
                f"--parallel.expert={expert} does not divide the shard group of {shard_group} ranks "
                f"({layout.shard_group_description}): an expert group splits the ranks that shard the "
                f"weights; {why}"
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def data_replicas(self) -> int:
        """How many groups of ranks read different micro-batches: the world size over the context size. The
        loaders deal each global batch into this many shares, and a step's gradient accumulation follows."""
        return self.world_size // self.context

    def data_rank(self, global_rank: int) -> int:
        """Which share of each global batch `global_rank` trains (its context group's)."""
        return global_rank // self.context

    def context_rank(self, global_rank: int) -> int:
        """Which slice of every row `global_rank` holds in its context group."""
        return global_rank % self.context

    @property
    def sharded(self) -> bool:
        """Whether FSDP wraps the model (more than one process); one process trains the model whole."""
        return self.world_size > 1

    @property
    def shard_group_size(self) -> int:
        """How many ranks split each parameter between them (1: every rank holds all of it)."""
        if not self.sharded or self.sharding_strategy == "NO_SHARD":
            return 1
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.devices  # shard within a node, replicate across nodes
        return self.world_size

    @property
    def shard_group_description(self) -> str:
        """What the shard group is made of, in words, for refusals."""
        if not self.sharded:
            return "one process"
        if self.sharding_strategy == "NO_SHARD":
            return "NO_SHARD"
        if self.sharding_strategy == "HYBRID_SHARD":
            return f"--devices={self.devices} of a node under HYBRID_SHARD"
        return f"--devices={self.devices} x --num_nodes={self.num_nodes}"

    def expert_rank(self, global_rank: int) -> int:
        """Which 1/expert of every MoE layer's experts `global_rank` owns: experts
        [expert_rank * E / expert, (expert_rank + 1) * E / expert)."""
        return global_rank % self.expert

    def expert_group(self, global_rank: int) -> list[int]:
        """The ranks of `global_rank`'s expert group: `expert` consecutive ranks (within one shard group, since
        `expert` divides its size and shard groups are consecutive ranks too)."""
        first = global_rank - self.expert_rank(global_rank)
        return list(range(first, first + self.expert))

    @property
    def expert_fsdp_mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh of the experts' weights, its last dimension the expert group: FSDP2 shards them over the
        dimension before it (the ranks of a shard group that own the same experts) and replicates them over
        a first "replicate" one under HYBRID_SHARD (the nodes), as it does every other weight."""
        efsdp = self.shard_group_size // self.expert
        if self.sharding_strategy == "HYBRID_SHARD":
            return (self.num_nodes, efsdp, self.expert), ("replicate", "efsdp", "expert")
        return (efsdp, self.expert), ("efsdp", "expert")

    @property
    def fsdp_mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The shape and dimension names of the mesh FSDP2 shards on: 1-D (shard) or 2-D (replicate, shard)."""
        if self.sharding_strategy == "NO_SHARD":
            return (self.world_size, 1), ("replicate", "shard")
        if self.sharding_strategy == "HYBRID_SHARD":
            return (self.num_nodes, self.devices), ("replicate", "shard")
        return (self.world_size,), ("shard",)

    def check_heads(self, num_heads: int, name: str) -> None:
        """Refuse a context size that does not divide the model's query heads (each context rank attends
        with 1/context of them), naming the sizes that would work."""
        if num_heads % self.context:
            sizes = ", ".join(str(d) for d in divisors(self.devices) if num_heads % d == 0)
            raise LitsftError(
                f"--parallel.context={self.context} does not divide {name}'s {num_heads} attention heads: each "
                f"context rank attends with an equal share of them; pick one of {sizes}"
            )

    def check_experts(self, num_experts: int, name: str) -> None:
        """Refuse an expert size that does not divide the model's experts (each expert rank owns an equal share
        of them, whole), or one asked of a model without experts, naming the sizes that would work."""
        if self.expert == 1:
            return
        if not num_experts:
            raise LitsftError(
                f"--parallel.expert={self.expert}: {name} has no experts (not a mixture of experts); drop it"
            )
        if num_experts % self.expert:
            sizes = ", ".join(str(d) for d in divisors(self.shard_group_size) if num_experts % d == 0)
            raise LitsftError(
                f"--parallel.expert={self.expert} does not divide {name}'s {num_experts} experts: each expert "
                f"rank owns an equal share of them; pick one of {sizes}"
            )

    def describe(self) -> str:
        """The layout in words, for the start-up line and `litsft plan`."""
        if not self.sharded:
            return "one process, no FSDP"
        text = f"{self.sharding_strategy}, shard group {self.shard_group_size}"
        if self.context > 1:
            text += f", context {self.context} x data {self.data_replicas}"
        if self.expert > 1:
            text += f", expert {self.expert} x expert-fsdp {self.shard_group_size // self.expert}"
        return text
