"""A replica's engine in a child process of its own (``backend: process``): vLLM's
EngineCore split, so the step loop never waits for a GIL the replica's Serve threads hold.

Owns :class:`EngineProcess`, the replica's side: it starts the child (``python -m
dsv41.deploy.engine_process FD``, the replica's interpreter, ``sys.path`` and
environment, so the same CUDA devices and torch threads), hands it the model and the
engine options over one socket pair, and is the :class:`SteppedEngine` the replica's
``AsyncEngine`` drives; and :func:`serve_engine`, the child's loop: it steps whenever it
holds unfinished requests, taking the commands that arrived between steps, and after
every turn sends one message with the step's delta outputs. The replica's threads (the
streams, the metrics, Serve's own) run while the child computes the next step.

The wire, each message one pickled object (``multiprocessing.connection``): to the child
``_Add`` / ``_Abort`` / ``_Shutdown``, each numbered; from it ``_Ready`` once, then per
turn any ``_Refused`` (an add the engine would not queue: its ``EngineError`` /
``SamplingParamsError``) and one ``_Stepped`` (the outputs, whether requests remain, the
number of the last command taken, and the engine's ``stats`` when they may have changed
or ``LOAD_REFRESH_S`` passed), or ``_Died`` when the step failed. An add is answered
asynchronously, so many adds arriving together are admitted in one turn:
:meth:`EngineProcess.step` raises :class:`RequestRefused` for a refused one. A command
queued while the step loop waits for the child's turn interrupts the wait
(:meth:`EngineProcess.interrupt_step`), so it is sent before the child's next step
rather than after it. Either side's death ends the other's reads: the child exits when
its socket closes (the replica exited or was killed), and the replica's reads raise
``EngineDeadError`` when the child's does. The replica's idle heap trim and memory probe
(deploy/heap.py, deploy/memory_probe.py) cover the replica's process only, not the
child's.

Must not import: ``ray``, ``torch``, ``actors``, or the HTTP modules of ``deploy``; from
``model`` only its config, from ``deploy`` only ``deploy.async_engine`` and
``deploy.procfs``; the child imports ``cluster.engine`` when it starts.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from dsv41.cluster.interface import EngineStats, RequestRefused, SteppedEngine
from dsv41.cluster.options import EngineError
from dsv41.cluster.request import RequestOutput
from dsv41.cluster.sampling_params import SamplingParams, SamplingParamsError
from dsv41.deploy.async_engine import LOAD_REFRESH_S, EngineDeadError
from dsv41.deploy.procfs import descendants, process_title
from dsv41.model.config import V41Config

logger = logging.getLogger(__name__)

# How long the child has to stop after a shutdown before it is killed.
SHUTDOWN_TIMEOUT_S = 10.0
# How often a replica waiting for its child's engine to load checks the child still runs.
START_POLL_S = 1.0


@dataclass(frozen=True)
class _Add:
    seq: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    seq: int
    request_id: str


@dataclass(frozen=True)
class _Shutdown:
    seq: int


@dataclass(frozen=True)
class _Ready:
    config: V41Config
    tokenizer_json: str
    max_model_len: int
    stats: EngineStats


@dataclass(frozen=True)
class _StartFailed:
    message: str


@dataclass(frozen=True)
class _Refused:
    request_id: str
    error: EngineError | SamplingParamsError


@dataclass(frozen=True)
class _Stepped:
    outputs: list[RequestOutput]
    unfinished: bool
    last_seq: int
    stats: EngineStats | None


@dataclass(frozen=True)
class _Died:
    message: str


_Command = _Add | _Abort | _Shutdown


def engine_processes(pid: int) -> set[int]:
    """The engine processes (this module's children) running below process ``pid``
    (read from /proc: empty where it cannot be read)."""
    title = f"-m {__name__}"
    return {child for child in descendants(pid) if (process_title(child) or "").endswith(title)}


def _describe(exc: BaseException) -> str:
    """An exception's last line (its type and message), what a replica's log names."""
    return traceback.format_exception_only(exc)[-1].strip()


class EngineProcess:
    """The replica's side of an engine in a child process (the module docstring).

    Built with the engine's ``model`` (a checkpoint directory or a generated slice) and
    ``options`` (EngineOptions fields, as ``Engine.from_pretrained`` takes them); returns
    once the child's engine is loaded, or raises ``RuntimeError`` naming why it could
    not start. Every method but :meth:`check_alive` and :meth:`close` is called from one
    thread, the ``AsyncEngine``'s step loop."""

    config: V41Config
    tokenizer: Tokenizer
    max_model_len: int

    def __init__(self, model: str | Path, options: dict[str, Any]) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(entry for entry in sys.path if entry))
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
            )
        self._conn = Connection(ours.detach())
        # Written by interrupt_step (any thread), read by step: a step loop waiting for
        # the child's turn wakes to send what was queued meanwhile.
        self._interrupt_reader, self._interrupt_writer = socket.socketpair()
        self._interrupt_reader.setblocking(False)
        self._interrupt_writer.setblocking(False)
        self._seq = 0
        self._last_seq = 0
        self._unfinished = False
        self._closed = False
        try:
            ready = self._start(str(model), options)
        except BaseException:
            self.close()
            raise
        self.config = ready.config
        self.tokenizer = Tokenizer.from_str(ready.tokenizer_json)
        self.max_model_len = ready.max_model_len
        self._stats = ready.stats

    @property
    def pid(self) -> int:
        return self._process.pid

    def _start(self, model: str, options: dict[str, Any]) -> _Ready:
        self._conn.send((model, options))
        while not self._conn.poll(START_POLL_S):
            code = self._process.poll()
            if code is not None:
                raise RuntimeError(f"the engine process exited with code {code} while loading {model}")
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"the engine process exited while loading {model}") from exc
        if isinstance(message, _StartFailed):
            raise RuntimeError(f"the engine process could not load {model}: {message.message}")
        assert isinstance(message, _Ready), message
        return message

    # -- SteppedEngine, on the step loop's thread -------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Sends the request; a refusal is raised by a later :meth:`step`."""
        self._send(lambda seq: _Add(seq, request_id, tuple(prompt_token_ids), params))

    def abort(self, request_id: str) -> bool:
        """Sends the abort (the child ignores a request it no longer holds); True."""
        self._send(lambda seq: _Abort(seq, request_id))
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether the child holds requests, or has commands of ours it has not
        answered yet: either way a message is on its way."""
        return self._unfinished or self._last_seq < self._seq

    def stats(self) -> EngineStats:
        """The child's latest snapshot (at most ``LOAD_REFRESH_S`` old while requests
        run unchanged)."""
        return self._stats

    def step(self) -> list[RequestOutput]:
        """The outputs of the child's next turn; nothing when :meth:`interrupt_step`
        woke it first; raises :class:`RequestRefused` for an add the child refused (call
        again for the turn's outputs) and ``EngineDeadError`` once the child died."""
        ready = wait([self._conn, self._interrupt_reader])
        if self._interrupt_reader in ready:
            self._drain_interrupts()
        if self._conn not in ready:
            return []
        message = self._recv()
        if isinstance(message, _Refused):
            raise RequestRefused(message.request_id, message.error)
        if isinstance(message, _Died):
            raise EngineDeadError(f"the engine process failed: {message.message}")
        assert isinstance(message, _Stepped), message
        # Stats first: another thread that sees the engine idle reads them (tests do).
        if message.stats is not None:
            self._stats = message.stats
        self._unfinished = message.unfinished
        self._last_seq = message.last_seq
        return message.outputs

    def _drain_interrupts(self) -> None:
        try:
            while self._interrupt_reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    # -- any thread -------------------------------------------------------------------

    def interrupt_step(self) -> None:
        """Makes a :meth:`step` that waits for the child return at once, with nothing
        (the AsyncEngine calls it after queueing a command, so the command reaches the
        child before its next turn instead of after it)."""
        try:
            self._interrupt_writer.send(b"\0")
        except BlockingIOError:
            pass  # full: a wake-up is already pending

    def check_alive(self) -> None:
        """Raises EngineDeadError once the child has exited."""
        code = self._process.poll()
        if code is not None:
            raise EngineDeadError(f"the engine process exited with code {code}")

    def close(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stops the child (killed when it does not stop within ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        if self._process.poll() is None:
            try:
                self._conn.send(_Shutdown(self._seq + 1))
            except OSError:
                pass
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
                self._process.kill()
                self._process.wait()
        self._conn.close()
        self._interrupt_reader.close()
        self._interrupt_writer.close()

    def _send(self, command: Any) -> None:
        self._seq += 1
        try:
            self._conn.send(command(self._seq))
        except OSError as exc:
            raise EngineDeadError("the engine process is gone") from exc

    def _recv(self) -> _Stepped | _Refused | _Died:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._process.wait()
            raise EngineDeadError(f"the engine process exited with code {code}") from exc


# -- the child ------------------------------------------------------------------------


def _take_commands(conn: Connection, *, block: bool) -> list[_Command]:
    """Every command that arrived; waits for the first only when ``block``."""
    commands: list[_Command] = [conn.recv()] if block else []
    while conn.poll(0):
        commands.append(conn.recv())
    return commands


def serve_engine(conn: Connection, engine: SteppedEngine) -> None:
    """The child's loop (the module docstring) until a ``_Shutdown``; raises EOFError
    when the replica's end of ``conn`` closes."""
    last_seq = 0
    next_stats = 0.0
    while True:
        commands = _take_commands(conn, block=not engine.has_unfinished_requests())
        for command in commands:
            last_seq = command.seq
            if isinstance(command, _Shutdown):
                return
            if isinstance(command, _Add):
                try:
                    engine.add_request(command.request_id, command.prompt_token_ids, command.params)
                except (EngineError, SamplingParamsError) as exc:
                    conn.send(_Refused(command.request_id, exc))
            else:
                engine.abort(command.request_id)
        try:
            outputs = engine.step() if engine.has_unfinished_requests() else []
        except BaseException as exc:  # noqa: BLE001 - any failure of a step ends the engine
            logger.exception("the engine step failed")
            conn.send(_Died(_describe(exc)))
            raise
        unfinished = engine.has_unfinished_requests()
        now = time.monotonic()
        stats = None
        if commands or not unfinished or now >= next_stats or any(output.finished for output in outputs):
            stats = engine.stats()
            next_stats = now + LOAD_REFRESH_S
        conn.send(_Stepped(outputs, unfinished, last_seq, stats))


def _child_main(fd: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # A Ctrl-C meant for a terminal's foreground group is the replica's to act on: the
    # child stops when the replica tells it or its socket closes, never half-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        model, options = conn.recv()
        from dsv41.cluster.engine import Engine

        try:
            engine = Engine.from_pretrained(model, **options)
        except Exception as exc:  # noqa: BLE001 - the replica is told why, and raises
            logger.exception("the engine could not load %s", model)
            conn.send(_StartFailed(_describe(exc)))
            return 1
        conn.send(_Ready(engine.config, engine.tokenizer.to_str(), engine.max_model_len, engine.stats()))
        serve_engine(conn, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the replica's end of the engine socket closed; exiting")
    return 0


if __name__ == "__main__":
    # Run as ``-m``, this file is ``__main__``; the messages are the package module's
    # classes (what the replica pickles), so the loop runs from that module.
    from dsv41.deploy import engine_process

    sys.exit(engine_process._child_main(int(sys.argv[1])))
