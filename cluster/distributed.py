"""Process groups of a DP replica and the MoE exchange across its ranks.

Owns: opening one torch.distributed process group per rank (gloo on CPU, NCCL on GPU)
from a key-value store (a TCP store at the head rank's free port across processes, a
hash store among threads of one process), and ``DPExpertExchange``, the MoE of one
layer when every rank holds an expert shard and its own attention rows: gather every
rank's rows (padded to the step's largest rank), each rank's routed contributions over
its experts for all rows in fp32 (through the kernels backend's grouped expert GEMMs),
the sum across ranks (gloo: all_reduce, it has no reduce_scatter; NCCL: reduce_scatter),
each rank keeping its own rows, the shared expert on its own rows. Padding rows of an
idle rank are zero rows that nobody keeps.

What crosses ranks depends on the batch-invariant mode (model/linalg.py). Outside it,
each rank's partial sum of a row. In it, a row's result must not depend on which rank
holds which expert: under EP the ranks sum whole (row, slot) contributions, each of
which one rank computed and the others hold as zeros (so the sum is exact in any
order), and every rank adds a row's slots in slot order, as one rank holding every
expert does; under TP the ranks gather each other's slot partials and add them in
rank order, so every placement of a request gives the same bits (though not a
one-rank engine's: its down projection reduces the intermediate dimension in one
GEMM, a TP group in ``world`` pieces).

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from dsv41.model.config import V41Config
from dsv41.model.kernels.interface import PagedKernels
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.linalg import ordered_sum
from dsv41.model.moe import combine_slots, expert_ffn, route
from dsv41.model.params import LayerParams
from dsv41.model.runtime import ExpertBanks

BACKENDS = ("gloo", "nccl")


class DistributedError(RuntimeError):
    """A process-group option or a step's metadata the exchange cannot use."""


@dataclass(frozen=True)
class GroupSpec:
    """How the ranks of one replica meet: the backend, the world size and the head
    rank's store address; ``timeout_s`` bounds every collective, so a dead peer ends
    a step with an error instead of a hang."""

    backend: str
    world: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise DistributedError(f"GroupSpec.backend: {self.backend!r} (allowed: {', '.join(BACKENDS)})")
        if not isinstance(self.world, int) or self.world < 1:
            raise DistributedError(f"GroupSpec.world: {self.world!r} (allowed: an int >= 1)")
        if not 0 <= self.master_port < 65536:
            raise DistributedError(f"GroupSpec.master_port: {self.master_port} (allowed: 0..65535)")
        if self.timeout_s <= 0:
            raise DistributedError(f"GroupSpec.timeout_s: {self.timeout_s} (allowed: > 0)")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the head rank's store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tcp_store(spec: GroupSpec, rank: int) -> dist.Store:
    """The rendezvous store: rank 0 serves it at ``master_addr:master_port``."""
    if spec.master_port == 0:
        raise DistributedError("GroupSpec.master_port: 0 (allowed: the head rank's port, from free_port())")
    return dist.TCPStore(spec.master_addr, spec.master_port, spec.world, rank == 0, spec.timeout)


def open_process_group(spec: GroupSpec, rank: int, store: dist.Store) -> dist.ProcessGroup:
    """Rank ``rank``'s handle on the replica's process group. The handle is used
    directly, not registered as the default group, so several replicas (or several
    ranks of one test process) can live side by side."""
    if not 0 <= rank < spec.world:
        raise DistributedError(f"rank: {rank} (allowed: 0..{spec.world - 1})")
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, spec.world, spec.timeout)
    return dist.ProcessGroupNCCL(store, rank, spec.world)


class DPExpertExchange:
    """The MoE of one layer across the DP ranks of a replica (a ``MoEFn``).

    Call ``begin_step`` with every rank's row count (from the step's DPMetadata, and
    per layer where a layer runs fewer rows: the decoder under bounded replay) before
    the forward; every layer's call then runs the same collectives on every rank, an
    idle rank contributing zero rows. The rank's routed contributions run on
    ``kernels`` (default: the torch reference); ``expert_mode`` is how the experts are
    split ("ep": whole experts per rank, "tp": an intermediate slice of each);
    ``batch_invariant`` is the replica's mode, fixed here rather than read from the
    calling thread because every rank's collectives must have the same shapes."""

    def __init__(
        self,
        config: V41Config,
        group: dist.ProcessGroup,
        rank: int,
        backend: str,
        kernels: PagedKernels | None = None,
        expert_mode: str = "ep",
        batch_invariant: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise DistributedError(f"backend: {backend!r} (allowed: {', '.join(BACKENDS)})")
        if expert_mode not in ("ep", "tp"):
            raise DistributedError(f"expert_mode: {expert_mode!r} (allowed: 'ep', 'tp')")
        self.expert_mode = expert_mode
        self.batch_invariant = batch_invariant
        self.config = config
        self.group = group
        self.rank = rank
        self.world = group.size()
        self.backend = backend
        self._row_counts: tuple[int, ...] | None = None
        self._layer_counts: dict[int, tuple[int, ...]] = {}
        self.experts = ExpertBanks(config, kernels or TorchKernels())

    def begin_step(self, row_counts: Sequence[int], layer_counts: Mapping[int, Sequence[int]] | None = None) -> None:
        """Every rank's rows this step; ``layer_counts``: every rank's rows at the
        layers that run fewer (by layer id)."""
        layer_counts = dict(layer_counts or {})
        for name, counts in (("row_counts", row_counts), *((f"layer_counts[{k}]", v) for k, v in layer_counts.items())):
            if len(counts) != self.world:
                raise DistributedError(f"{name}: {len(counts)} ranks (allowed: the world size {self.world})")
        self._row_counts = tuple(row_counts)
        self._layer_counts = {layer: tuple(counts) for layer, counts in layer_counts.items()}

    def __call__(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        if self._row_counts is None:
            raise DistributedError("DPExpertExchange: called before begin_step() of this step")
        counts = self._layer_counts.get(layer.layer_id, self._row_counts)
        if h.shape[0] != counts[self.rank]:
            raise DistributedError(
                f"layer {layer.layer_id}: rank {self.rank} has {h.shape[0]} rows, the step's metadata says "
                f"{counts[self.rank]}"
            )
        if not any(counts):
            # No rank has a row here (a decoder no rank's rows reach): every rank
            # skips the collectives alike.
            return h
        cfg = self.config
        pad = max(counts)
        padded = h.new_zeros(self.world * pad, h.shape[1])
        gathered = padded.view(self.world, pad, h.shape[1])
        own = padded.new_zeros(pad, h.shape[1])
        own[: h.shape[0]] = h
        self._all_gather(gathered, own)
        valid = torch.cat([torch.arange(r * pad, r * pad + n, device=h.device) for r, n in enumerate(counts)])
        rows = padded[valid]
        routing = route(rows, layer.moe.gate, layer.moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        slots = self.experts.slots(layer, rows, routing)
        if not self.batch_invariant:
            partial = torch.zeros(self.world * pad, h.shape[1], dtype=torch.float32, device=h.device)
            partial[valid] = combine_slots(slots)
            out = self._reduce_own(partial, pad)[: h.shape[0]]
        else:
            every = slots.new_zeros(self.world * pad, *slots.shape[1:])
            every[valid] = slots
            out = combine_slots(self._exact_slot_sum(every, pad)[: h.shape[0]])
        if layer.moe.shared is not None:
            out = out + expert_ffn(h, layer.moe.shared, cfg.swiglu_limit)
        return out.to(h.dtype)

    def _all_gather(self, gathered: torch.Tensor, own: torch.Tensor) -> None:
        if self.backend == "nccl":
            self.group._allgather_base(gathered.view(-1, own.shape[1]), own).wait()
            return
        self.group.allgather([list(gathered.unbind(0))], [own]).wait()

    def _exact_slot_sum(self, slots: torch.Tensor, pad: int) -> torch.Tensor:
        """This rank's ``pad`` rows of every rank's (row, slot) contributions [world *
        pad, k, hidden], summed in an order no placement changes."""
        if self.expert_mode == "ep":
            return self._reduce_own(slots.flatten(1), pad).view(pad, *slots.shape[1:])
        gathered = slots.new_empty(self.world, *slots.shape)
        self._all_gather(gathered.flatten(2), slots.flatten(1))
        return ordered_sum(gathered[:, self.rank * pad : (self.rank + 1) * pad].unbind(0))

    def _reduce_own(self, partial: torch.Tensor, pad: int) -> torch.Tensor:
        """Sums every rank's partials and returns this rank's ``pad`` rows."""
        if self.backend == "nccl":
            mine = partial.new_empty(pad, partial.shape[1])
            self.group._reduce_scatter_base(mine, partial).wait()
            return mine
        self.group.allreduce([partial]).wait()
        return partial[self.rank * pad : (self.rank + 1) * pad]
