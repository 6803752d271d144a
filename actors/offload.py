"""OffloadActor: one node's tiered store of PAGE units and STATE images, served to
ranks on any node through the Ray object store.

Owns the actor around ``cache.offload.TieredStore`` and ``RayOffloadConnector``, the
``cluster.offload_connector.OffloadConnector`` a replica's scheduler and ranks use
to reach it: ranks publish units without waiting (the rows ride in the call), the
scheduler looks a prompt's keys up and gets a pin token per unit held (the actor keeps
those rows, even if the store evicts the unit, until the token is taken or
``pin_ttl_s`` passes), and the rank that runs the request takes the rows with its
token: they travel from the actor's node through the object store to the rank's.
Tokens rather than object references ride in the step, because the step's wire is
plain pickle, which does not carry an object reference's owner.

The store is a cache, so losing it costs only recomputation: its group starts it with
``max_restarts`` (Ray brings a killed one back, empty, under the same handle), and the
scheduler's connector answers misses while the store is unreachable (a lookup that
fails or passes ``call_timeout_s``) until a ping gets through. A rank's ``fetch`` has no
such way out: the rows a lookup pinned are gone with the store, so if the store dies
between a lookup and the fetch of the same step, the step fails and the group restarts.

Must not import: deploy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import ray
import torch

from dsv41.cache.offload import OffloadError, OffloadKey, TieredStore

logger = logging.getLogger(__name__)

DEFAULT_PIN_TTL_S = 120.0
# How long the scheduler waits for a lookup before taking the store as gone: calls to
# a restarting actor wait for it instead of failing.
DEFAULT_CALL_TIMEOUT_S = 1.0


class OffloadActor:
    """A node's offload store; create with ``ray.remote(OffloadActor)``."""

    def __init__(
        self,
        layout_id: str,
        page_bytes: int,
        host_budget_bytes: int,
        disk_dir: str | None = None,
        disk_budget_bytes: int = 0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
    ) -> None:
        if pin_ttl_s <= 0:
            raise OffloadError(f"pin_ttl_s: {pin_ttl_s} (allowed: > 0)")
        self.pin_ttl_s = pin_ttl_s
        self._pinned: dict[str, tuple[torch.Tensor, float]] = {}
        self.store = TieredStore(
            layout_id,
            page_bytes,
            host_budget_bytes,
            disk_dir=Path(disk_dir) if disk_dir is not None else None,
            disk_budget_bytes=disk_budget_bytes,
        )

    def put(self, key: OffloadKey, rows: torch.Tensor) -> None:
        self.store.put(key, rows)

    def get(self, key: OffloadKey) -> torch.Tensor | None:
        return self.store.get(key)

    def lookup(self, keys: list[OffloadKey]) -> list[str | None]:
        """A pin token for each held unit (None where not held): ``take`` returns its
        rows until ``pin_ttl_s`` has passed, whatever the store evicts meanwhile."""
        self._expire()
        tokens: list[str | None] = []
        for key in keys:
            rows = self.store.get(key) if key in self.store else None
            if rows is None:
                tokens.append(None)
                continue
            token = uuid.uuid4().hex
            self._pinned[token] = (rows, time.monotonic() + self.pin_ttl_s)
            tokens.append(token)
        return tokens

    def take(self, token: str) -> torch.Tensor:
        """The rows a lookup pinned under ``token`` (once)."""
        self._expire()
        entry = self._pinned.pop(token, None)
        if entry is None:
            raise OffloadError(f"token: {token!r} is not pinned (taken already, or older than {self.pin_ttl_s} s)")
        return entry[0]

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, deadline) in self._pinned.items() if deadline < now]:
            del self._pinned[token]

    def ping(self) -> None:
        """Answers once the actor is up (a restarted one, once its store is built)."""

    def contains(self, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds (one call for a whole prefix)."""
        return [key in self.store for key in keys]

    def stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.store.stats()) | {"pinned": len(self._pinned)}


class RayOffloadConnector:
    """The OffloadConnector of a replica whose store is an OffloadActor; picklable,
    so the scheduler actor and every rank actor hold one (a copy starts reachable).

    ``lookup`` never fails: while the store is unreachable it answers misses at once
    (the prompt is recomputed), and one ping in flight says when it is back."""

    def __init__(self, actor: Any, layout_id: str, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        if not call_timeout_s > 0:
            raise OffloadError(f"call_timeout_s: {call_timeout_s} (allowed: > 0)")
        self.actor = actor
        self.layout_id = layout_id
        self.call_timeout_s = call_timeout_s
        self._ping: ray.ObjectRef | None = None  # in flight while the store is unreachable

    def __reduce__(self) -> tuple[Any, ...]:
        return (RayOffloadConnector, (self.actor, self.layout_id, self.call_timeout_s))

    @property
    def available(self) -> bool:
        """Whether the store answers (as far as the last call or ping knows)."""
        if self._ping is None:
            return True
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return False
        try:
            ray.get(self._ping)
        except ray.exceptions.RayError:
            self._ping = self.actor.ping.remote()
            return False
        self._ping = None
        logger.info("offload store back: lookups reach it again")
        return True

    def _answer(self, call: Callable[[], ray.ObjectRef]) -> Any | None:
        """What ``call``'s ref resolves to within ``call_timeout_s``; None (and a ping
        sent) when the store is unreachable, at once while it is known to be."""
        if not self.available:
            return None
        try:
            return ray.get(call(), timeout=self.call_timeout_s)
        except ray.exceptions.RayError as exc:
            logger.warning("offload store unreachable (%s): prompts recompute until it is back", type(exc).__name__)
            self._ping = self.actor.ping.remote()
            return None

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Any | None]:
        handles = self._answer(lambda: self.actor.lookup.remote(list(keys)))
        return handles if handles is not None else [None] * len(keys)

    def fetch(self, handle: Any) -> torch.Tensor:
        # No deadline of its own: the step's bounds it, and a store that restarted
        # answers at once that the token is not pinned.
        return ray.get(self.actor.take.remote(handle))

    def publish(self, key: OffloadKey, rows: torch.Tensor) -> None:
        # Fire and forget: the rows are serialised into the call now; a lookup that
        # arrives before the put lands is a miss, which only costs a recompute (and
        # a put sent while the store restarts waits for it, or is lost with it).
        self.actor.put.remote(key, rows)

    def stats(self) -> dict[str, int] | None:
        """The store's counters, or None while it is unreachable."""
        return self._answer(self.actor.stats.remote)
