"""RankActor: one DP-attention rank of an engine group in its own Ray worker.

Owns the process side of a rank: joining the group's process group (the head rank
serves the rendezvous store at a port free on its node), loading its ``DPRank`` (TP1
attention, embeddings, head, its own pools, one routed-expert shard; the group's
offload connector) and running its batch of each step. Everything it computes is
``cluster.ranks.DPRank``'s. Its step comes in as bytes (``execute_packed``: the
rank's end of ``actors.step_wire``), through whichever transport of ``actors.transport``
the group runs (``serve_steps`` opens the socket one).

Must not import: deploy.
"""

from __future__ import annotations

import socket
import threading

import torch

from dsv41.actors.step_wire import pack_result, unpack_step
from dsv41.actors.transport import connect_to_driver, serve_connection
from dsv41.cluster.batch import ScheduledBatch
from dsv41.cluster.distributed import GroupSpec, free_port, open_process_group, tcp_store
from dsv41.cluster.offload_connector import OffloadConnector
from dsv41.cluster.options import EngineOptions
from dsv41.cluster.ranks import DPLayout, DPRank
from dsv41.cluster.runner import StepResult
from dsv41.model.source import ModelSource


class RankActor:
    """One rank; use through ``actors.group`` (it places, wires and restarts ranks)."""

    def __init__(
        self, model: ModelSource, options: EngineOptions, dp: DPLayout, rank: int, offload: OffloadConnector | None = None
    ) -> None:
        # Several ranks share a CPU box: one intra-op thread each keeps them from
        # oversubscribing it and keeps results independent of thread splits.
        torch.set_num_threads(1)
        self.model = model
        self.options = options
        self.dp = dp
        self.rank = rank
        self.offload = offload
        self._worker: DPRank | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it: the head rank's store."""
        host = socket.gethostbyname(socket.gethostname())
        return host, free_port(host)

    def join(self, spec: GroupSpec) -> int:
        """Joins the process group and loads the rank's weights and pools."""
        group = None
        if spec.world > 1:
            group = open_process_group(spec, self.rank, tcp_store(spec, self.rank))
        self._worker = DPRank.load(self.model, self.options, self.dp, self.rank, group, self.offload)
        return self.rank

    def execute(self, batch: ScheduledBatch, metadata_wire: torch.Tensor | None) -> StepResult:
        if self._worker is None:
            raise RuntimeError(f"rank {self.rank}: execute() before join()")
        return self._worker.execute(batch, metadata_wire)

    def execute_packed(self, step: bytes) -> bytes:
        """``execute`` over the step wire (``actors.step_wire``): ``pack_step``'s bytes
        in, ``pack_result``'s bytes out."""
        batch, metadata_words = unpack_step(step)
        metadata = None if metadata_words is None else torch.tensor(metadata_words, dtype=torch.int64)
        return pack_result(self.execute(batch, metadata))

    def serve_steps(self, host: str, port: int, token: bytes, timeout_s: float) -> None:
        """Connects to a socket transport's driver and serves its steps from a thread
        of this process until the driver closes the connection."""
        conn = connect_to_driver(host, port, token, self.rank, timeout_s)
        threading.Thread(
            target=serve_connection, args=(conn, self.execute_packed, self.rank), name="step-socket", daemon=True
        ).start()

    def ping(self) -> int:
        """Health check: answers with the rank id once joined."""
        if self._worker is None:
            raise RuntimeError(f"rank {self.rank}: not joined")
        return self.rank
