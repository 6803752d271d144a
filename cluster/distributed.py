"""Process groups of a DP replica and the MoE exchange across its ranks.

Owns: opening one torch.distributed process group per rank (gloo on CPU, NCCL on GPU)
from a key-value store (a TCP store at the head rank's free port across processes, a
hash store among threads of one process), and ``DPExpertExchange``, the MoE of one
layer when every rank holds an expert shard and its own attention rows: gather every
rank's rows (padded to the step's largest rank), each rank's routed contributions over
its experts for all rows in fp32 (through the kernels backend's grouped expert GEMMs),
the sum across ranks (gloo: all_reduce, it has no reduce_scatter; NCCL: reduce_scatter),
each rank keeping its own rows, the shared expert on its own rows. Padding rows of an
idle rank are zero rows that nobody keeps. Each call issues its collectives as
asynchronous work and can yield while they are in flight (model/microbatch.py), which
is how a two-batch-overlap microbatch's MoE overlaps the other's compute.

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

import contextlib
import datetime
import functools
import socket
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from dsv41.model.config import V41Config
from dsv41.model.kernels.interface import PagedKernels
from dsv41.model.kernels.torch_backend import TorchKernels
from dsv41.model.linalg import ordered_sum
from dsv41.model.microbatch import MoESteps, Steps, run_steps
from dsv41.model.moe import combine_slots, expert_ffn
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
    calling thread because every rank's collectives must have the same shapes.

    Under prefill two-batch overlap a step's rows run as two microbatches, each with
    its own counts (``begin_step``'s ``microbatches``): ``microbatch(i)`` is the MoE
    of microbatch i, which pads to that microbatch's largest rank and yields while
    its gather and its reduce are in flight (asynchronous gloo work on the CPU; the
    communication stream on a GPU, ``CommStream``), so the other microbatch's
    attention and experts run meanwhile."""

    def __init__(
        self,
        config: V41Config,
        group: dist.ProcessGroup,
        rank: int,
        backend: str,
        kernels: PagedKernels | None = None,
        expert_mode: str = "ep",
        batch_invariant: bool = False,
        device: str = "cpu",
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
        self._microbatches: tuple[tuple[tuple[int, ...], dict[int, tuple[int, ...]]], ...] = ()
        self._comm = CommStream(torch.device(device))
        self.experts = ExpertBanks(config, kernels or TorchKernels())

    def begin_step(
        self,
        row_counts: Sequence[int],
        layer_counts: Mapping[int, Sequence[int]] | None = None,
        microbatches: Sequence[tuple[Sequence[int], Mapping[int, Sequence[int]]]] = (),
    ) -> None:
        """Every rank's rows this step; ``layer_counts``: every rank's rows at the
        layers that run fewer (by layer id). ``microbatches``: under prefill two-batch
        overlap, each microbatch's (row counts, layer counts), which its MoE
        (``microbatch(i)``) pads and cuts by."""
        self._row_counts, self._layer_counts = self._checked("", row_counts, layer_counts)
        self._microbatches = tuple(
            self._checked(f"microbatches[{i}].", rows, layers) for i, (rows, layers) in enumerate(microbatches)
        )

    def begin_uniform_step(self, rows: int) -> None:
        """A step in which every rank runs ``rows`` rows at every layer, padding
        included (a decode graph's width, which every rank replays): the exchange's
        shapes then depend on ``rows`` alone, so a captured graph's collectives meet
        every peer's."""
        self.begin_step((rows,) * self.world)

    def _checked(
        self, name: str, row_counts: Sequence[int], layer_counts: Mapping[int, Sequence[int]] | None
    ) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
        layer_counts = dict(layer_counts or {})
        for field, counts in (("row_counts", row_counts), *((f"layer_counts[{k}]", v) for k, v in layer_counts.items())):
            if len(counts) != self.world:
                raise DistributedError(f"{name}{field}: {len(counts)} ranks (allowed: the world size {self.world})")
        return tuple(row_counts), {layer: tuple(counts) for layer, counts in layer_counts.items()}

    def __call__(self, layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        return run_steps(self._steps(layer, h, None))

    def microbatch(self, index: int) -> MoESteps:
        """The MoE of microbatch ``index`` of this step (begin_step's
        ``microbatches``), yielding while its gather and its reduce are in flight."""
        if not 0 <= index < len(self._microbatches):
            raise DistributedError(f"microbatch: {index} (allowed: 0..{len(self._microbatches) - 1} this step)")
        return functools.partial(self._steps, microbatch=index)

    def _steps(self, layer: LayerParams, h: torch.Tensor, microbatch: int | None) -> Steps[torch.Tensor]:
        if self._row_counts is None:
            raise DistributedError("DPExpertExchange: called before begin_step() of this step")
        row_counts, layer_counts = (self._row_counts, self._layer_counts)
        if microbatch is not None:
            row_counts, layer_counts = self._microbatches[microbatch]
        counts = layer_counts.get(layer.layer_id, row_counts)
        if h.shape[0] != counts[self.rank]:
            where = "" if microbatch is None else f" in microbatch {microbatch}"
            raise DistributedError(
                f"layer {layer.layer_id}: rank {self.rank} has {h.shape[0]} rows{where}, the step's metadata says "
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
        overlap = microbatch is not None
        gather = self._all_gather(gathered, own, overlap)
        # Collectives in flight: another microbatch computes meanwhile.
        yield
        gather.wait()
        valid = torch.cat([torch.arange(r * pad, r * pad + n, device=h.device) for r, n in enumerate(counts)])
        rows = padded[valid]
        routing = self.experts.kernels.route(
            rows, layer.moe.gate, layer.moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        )
        slots = self.experts.slots(layer, rows, routing)
        if not self.batch_invariant:
            partial = torch.zeros(self.world * pad, h.shape[1], dtype=torch.float32, device=h.device)
            partial[valid] = combine_slots(slots)
            reduce, mine = self._reduce_own(partial, pad, overlap)
        else:
            every = slots.new_zeros(self.world * pad, *slots.shape[1:])
            every[valid] = slots
            reduce, mine = self._exact_slot_sum(every, pad, overlap)
        shared = None if layer.moe.shared is None else expert_ffn(h, layer.moe.shared, cfg.swiglu_limit)
        yield
        reduce.wait()
        out = mine()[: h.shape[0]]
        if self.batch_invariant:
            out = combine_slots(out)
        if shared is not None:
            out = out + shared
        return out.to(h.dtype)

    def _all_gather(self, gathered: torch.Tensor, own: torch.Tensor, overlap: bool) -> dist.Work:
        """Issues the gather of every rank's ``own`` into ``gathered`` [world, ...]
        (``overlap``: a microbatch's, on the communication stream of a GPU); the
        caller waits on the work."""
        with self._comm.issue(overlap):
            if self.backend == "nccl":
                return self.group._allgather_base(gathered.view(-1, own.shape[1]), own)
            return self.group.allgather([list(gathered.unbind(0))], [own])

    def _exact_slot_sum(
        self, slots: torch.Tensor, pad: int, overlap: bool
    ) -> tuple[dist.Work, Callable[[], torch.Tensor]]:
        """Issues the sum of every rank's (row, slot) contributions [world * pad, k,
        hidden] in an order no placement changes; once the work is done, the callable
        gives this rank's ``pad`` rows of it."""
        if self.expert_mode == "ep":
            work, mine = self._reduce_own(slots.flatten(1), pad, overlap)
            return work, lambda: mine().view(pad, *slots.shape[1:])
        gathered = slots.new_empty(self.world, *slots.shape)
        work = self._all_gather(gathered.flatten(2), slots.flatten(1), overlap)
        return work, lambda: ordered_sum(gathered[:, self.rank * pad : (self.rank + 1) * pad].unbind(0))

    def _reduce_own(
        self, partial: torch.Tensor, pad: int, overlap: bool
    ) -> tuple[dist.Work, Callable[[], torch.Tensor]]:
        """Issues the sum of every rank's partials; once the work is done, the
        callable gives this rank's ``pad`` rows of it."""
        if self.backend == "nccl":
            mine = partial.new_empty(pad, partial.shape[1])
            with self._comm.issue(overlap):
                return self.group._reduce_scatter_base(mine, partial), lambda: mine
        with self._comm.issue(overlap):
            work = self.group.allreduce([partial])
        return work, lambda: partial[self.rank * pad : (self.rank + 1) * pad]


class CommStream:
    """Where the exchange issues its collectives. On a CUDA device a stream of its own
    at priority -1 (the spec's communication stream: under two-batch overlap one
    microbatch's collectives are queued there while the other's compute runs on the
    compute stream); it first waits for the compute stream, so a collective reads
    what was computed before it was issued, and ``Work.wait()`` later makes the
    compute stream wait for the collective. NCCL records the tensors it reads and
    writes on its own streams, so the caching allocator does not reuse them early.
    Elsewhere (gloo on the CPU) collectives run on gloo's threads: nothing to set.
    The CUDA path has not run here (no GPU in this session)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None

    @contextlib.contextmanager
    def issue(self, overlap: bool) -> Iterator[None]:
        """Collectives issued inside go to the communication stream when ``overlap``
        (a microbatch's, whose wait comes after the other microbatch's compute) and
        there is one; an ordinary call waits at once, on the compute stream."""
        if self.stream is None or not overlap:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
