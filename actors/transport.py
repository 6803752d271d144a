"""Step transports: how one step's packed batches reach the ranks and their results come back.

Owns ``StepTransport`` and its kinds (``TRANSPORTS``): ``sockets`` (one TCP connection
per rank, opened by the rank to the driver; the default), ``compiled`` (a Ray compiled
graph over the ranks) and ``calls`` (one Ray actor call per rank per step); the framing
of the socket kind on both ends (``serve_connection`` runs in a rank's process); and
the failures every kind raises the same way (``RankGroupFailure``: a rank's exception,
a dead rank, a missed deadline). What travels is opaque bytes: ``actors.step_wire``
packs the steps and unpacks the results.

Must not import: deploy.
"""

from __future__ import annotations

import abc
import hmac
import logging
import secrets
import select
import selectors
import socket
import struct
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import ray
from ray.dag import InputNode, MultiOutputNode

from dsv41.cluster.ranks import RankFailure

logger = logging.getLogger(__name__)

TRANSPORTS = ("sockets", "compiled", "calls")

# A frame: step sequence number, status, payload length, then the payload. A rank
# answers each step with the step's sequence number, so a reply left unread by a
# failed step (another rank raised first) is recognised and dropped by the next one.
FRAME_HEADER = struct.Struct("!QBQ")
FRAME_OK, FRAME_FAILED = 0, 1
# What a rank sends first on its connection: the transport's token and its rank.
HELLO = struct.Struct("!16sI")
TOKEN_BYTES = 16
RECV_CHUNK = 1 << 20


class RankGroupFailure(RankFailure):
    """A rank died, failed or missed a deadline; the group must restart."""


class RankGroupDead(RuntimeError):
    """The group cannot serve: a generation failed to start, or the group was
    stopped. Not a RankFailure: no restart is tried; the replica must be replaced."""


@contextmanager
def failing_as(what: str) -> Iterator[None]:
    """Raises any Ray failure inside as RankGroupFailure naming ``what``. ray.get over
    a list fails fast: the first dead rank (answered at once) or failed rank raises
    without waiting for the ranks still blocked in a collective with it."""
    try:
        yield
    except ray.exceptions.RayError as exc:
        raise RankGroupFailure(f"{what}: {type(exc).__name__}: {exc}") from exc


class StepTransport(abc.ABC):
    """Carries each rank's packed step (``actors.step_wire.pack_step``) to the ranks'
    ``execute_packed`` and their packed results back, one generation of ranks long.
    ``exchange`` returns the results in rank order, or raises RankGroupFailure at the
    first failure: a dead rank (at once), a rank's exception (without waiting for the
    ranks blocked in a collective with it), or the deadline."""

    kind: str

    def __init__(self, group_name: str, ranks: Sequence[Any]) -> None:
        self.group_name = group_name
        self.ranks = list(ranks)

    @property
    def what(self) -> str:
        return f"group {self.group_name} ({self.kind} transport)"

    def exchange(self, steps: Sequence[bytes], timeout_s: float) -> list[bytes]:
        if len(steps) != len(self.ranks):
            raise ValueError(f"steps: {len(steps)} (allowed: one per rank, {len(self.ranks)})")
        return self._exchange(steps, timeout_s)

    @abc.abstractmethod
    def _exchange(self, steps: Sequence[bytes], timeout_s: float) -> list[bytes]: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Releases what the transport holds on the ranks (they stay alive)."""


class RayRefTransport(StepTransport):
    """A transport whose step is a list of Ray refs, one per rank."""

    def _exchange(self, steps: Sequence[bytes], timeout_s: float) -> list[bytes]:
        with failing_as(self.what):
            return ray.get(self._submit(steps), timeout=timeout_s)

    @abc.abstractmethod
    def _submit(self, steps: Sequence[bytes]) -> list[Any]:
        """Starts the step on every rank; one ref (ObjectRef or CompiledDAGRef) each."""


class CallTransport(RayRefTransport):
    """One Ray actor call per rank per step: each a task submitted to the rank's
    worker and its result returned through the core worker."""

    kind = "calls"

    def _submit(self, steps: Sequence[bytes]) -> list[Any]:
        return [rank.execute_packed.remote(step) for rank, step in zip(self.ranks, steps)]

    def close(self) -> None:
        pass


class CompiledTransport(RayRefTransport):
    """A Ray compiled graph over the ranks: input i is rank i's step, the outputs are
    every rank's result (``MultiOutputNode``). Each rank runs a loop reading its input
    channel, so a step costs a shared-memory write and reads instead of task
    submissions. Ray's channel reads poll (sched_yield) rather than sleep: each rank's
    loop and the waiting driver use CPU while they wait. One graph per generation of
    ranks (an actor runs one graph at a time)."""

    kind = "compiled"

    def __init__(self, group_name: str, ranks: Sequence[Any], submit_timeout_s: float) -> None:
        super().__init__(group_name, ranks)
        with InputNode() as steps:
            outputs = MultiOutputNode([rank.execute_packed.bind(steps[i]) for i, rank in enumerate(self.ranks)])
        self.graph = outputs.experimental_compile(_submit_timeout=submit_timeout_s)

    def _submit(self, steps: Sequence[bytes]) -> list[Any]:
        return self.graph.execute(*steps)

    def close(self) -> None:
        self.graph.teardown()


class _FrameReader:
    """Accumulates one connection's bytes into frames."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def frames(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        self.buffer += data
        while len(self.buffer) >= FRAME_HEADER.size:
            seq, status, size = FRAME_HEADER.unpack_from(self.buffer)
            end = FRAME_HEADER.size + size
            if len(self.buffer) < end:
                return
            payload = bytes(self.buffer[FRAME_HEADER.size : end])
            del self.buffer[:end]
            yield seq, status, payload


def frame(seq: int, status: int, payload: bytes) -> bytes:
    return FRAME_HEADER.pack(seq, status, len(payload)) + payload


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None if the peer closed the connection first."""
    chunks = bytearray()
    while len(chunks) < size:
        data = conn.recv(min(RECV_CHUNK, size - len(chunks)))
        if not data:
            return None
        chunks += data
    return bytes(chunks)


def serve_connection(conn: socket.socket, handle: Callable[[bytes], bytes], rank: int) -> None:
    """A rank's end of the socket transport, run in a thread of the rank's process:
    answers each step frame with ``handle``'s result, or with the traceback of its
    exception (the rank stays up: the driver decides), until the driver closes the
    connection. Waiting for a step is a blocking read: the thread sleeps."""
    with conn:
        while True:
            header = _recv_exactly(conn, FRAME_HEADER.size)
            if header is None:
                return
            seq, _, size = FRAME_HEADER.unpack(header)
            payload = _recv_exactly(conn, size)
            if payload is None:
                return
            try:
                reply, status = handle(payload), FRAME_OK
            except Exception:  # noqa: BLE001 - sent to the driver, which fails the step
                logger.exception("rank %d: step %d failed", rank, seq)
                reply, status = traceback.format_exc().encode(), FRAME_FAILED
            try:
                conn.sendall(frame(seq, status, reply))
            except OSError:
                return


def connect_to_driver(host: str, port: int, token: bytes, rank: int, timeout_s: float) -> socket.socket:
    """A rank's connection to the driver of a socket transport, introduced."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(HELLO.pack(token, rank))
    conn.settimeout(None)
    return conn


class SocketTransport(StepTransport):
    """One TCP connection per rank, which the rank opens to a listener on the driver's
    node (``RankActor.serve_steps``) and serves from a thread (``serve_connection``).
    A step is one framed write to every rank and one framed read back from each: no
    task submission, no object store, and a waiting rank sleeps in a blocking read
    (nothing polls). A dead rank's connection closes, so the step fails at once; a
    rank's exception comes back as its traceback. Connections are introduced by a
    random token, so a stray connection to the listener is refused."""

    kind = "sockets"

    def __init__(self, group_name: str, ranks: Sequence[Any], connect_timeout_s: float) -> None:
        super().__init__(group_name, ranks)
        self._seq = 0
        host = ray.util.get_node_ip_address()
        token = secrets.token_bytes(TOKEN_BYTES)
        deadline = time.monotonic() + connect_timeout_s
        self.conns: list[socket.socket] = []
        self._selector = selectors.DefaultSelector()
        with socket.create_server((host, 0), backlog=len(self.ranks)) as listener:
            port = listener.getsockname()[1]
            with failing_as(f"{self.what}: connecting the ranks"):
                ray.get(
                    [r.serve_steps.remote(host, port, token, connect_timeout_s) for r in self.ranks],
                    timeout=connect_timeout_s,
                )
            try:
                self.conns = self._accept(listener, token, deadline)
            except BaseException:
                self.close()
                raise
        # One reader per connection for the transport's life: the rest of an answer
        # left unread when an earlier step failed may arrive with the next step.
        self._readers = [_FrameReader() for _ in self.conns]
        for rank, conn in enumerate(self.conns):
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, rank)

    def _accept(self, listener: socket.socket, token: bytes, deadline: float) -> list[socket.socket]:
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < len(self.ranks):
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, peer = listener.accept()
            except TimeoutError as exc:
                for conn in by_rank.values():
                    conn.close()
                missing = sorted(set(range(len(self.ranks))) - set(by_rank))
                raise RankGroupFailure(f"{self.what}: TimeoutError: ranks {missing} did not connect") from exc
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            hello = _recv_exactly(conn, HELLO.size)
            got_token, rank = HELLO.unpack(hello) if hello is not None else (b"", -1)
            if not hmac.compare_digest(got_token, token) or not 0 <= rank < len(self.ranks) or rank in by_rank:
                logger.warning("%s: refused a connection from %s", self.what, peer)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            by_rank[rank] = conn
        return [by_rank[rank] for rank in range(len(self.ranks))]

    def _exchange(self, steps: Sequence[bytes], timeout_s: float) -> list[bytes]:
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        for rank, (conn, step) in enumerate(zip(self.conns, steps)):
            self._send(rank, conn, frame(seq, FRAME_OK, step), deadline)
        results: list[bytes | None] = [None] * len(self.conns)
        while None in results:
            ready = self._selector.select(max(deadline - time.monotonic(), 0))
            if not ready:
                late = [rank for rank, result in enumerate(results) if result is None]
                raise RankGroupFailure(f"{self.what}: TimeoutError: ranks {late} did not answer step {seq} in {timeout_s} s")
            for key, _ in ready:
                rank = key.data
                data = self._recv(rank, key.fileobj)
                for got_seq, status, payload in self._readers[rank].frames(data):
                    if got_seq != seq:
                        continue  # the answer to a step that failed on another rank
                    if status != FRAME_OK:
                        raise RankGroupFailure(f"{self.what}: rank {rank} failed step {seq}:\n{payload.decode()}")
                    results[rank] = payload
        return [result for result in results if result is not None]

    def _send(self, rank: int, conn: socket.socket, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = conn.send(view)
            except BlockingIOError:
                # The rank's receive buffer is full: wait until it reads, within the deadline.
                if not select.select([], [conn], [], max(deadline - time.monotonic(), 0))[1]:
                    raise RankGroupFailure(f"{self.what}: TimeoutError: rank {rank} did not take its step") from None
                continue
            except OSError as exc:
                raise RankGroupFailure(f"{self.what}: rank {rank} connection lost: {exc!r}") from exc
            view = view[sent:]

    def _recv(self, rank: int, conn: Any) -> bytes:
        try:
            data = conn.recv(RECV_CHUNK)
        except BlockingIOError:
            return b""  # a spurious wake-up: nothing to read yet
        except OSError as exc:
            raise RankGroupFailure(f"{self.what}: rank {rank} connection lost: {exc!r}") from exc
        if not data:
            raise RankGroupFailure(f"{self.what}: rank {rank} closed its connection (its process ended)")
        return data

    def close(self) -> None:
        self._selector.close()
        for conn in self.conns:
            conn.close()
        self.conns = []


def open_transport(kind: str, group_name: str, ranks: Sequence[Any], timeout_s: float) -> StepTransport:
    """The step transport ``kind`` (one of TRANSPORTS) over ``ranks``, each an actor
    with ``execute_packed(bytes) -> bytes`` (and ``serve_steps`` for sockets);
    ``timeout_s`` bounds its opening."""
    if kind == "sockets":
        return SocketTransport(group_name, ranks, timeout_s)
    if kind == "compiled":
        return CompiledTransport(group_name, ranks, timeout_s)
    if kind == "calls":
        return CallTransport(group_name, ranks)
    raise ValueError(f"transport: {kind!r} (allowed: {', '.join(TRANSPORTS)})")
