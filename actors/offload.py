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

Must not import: deploy.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import ray
import torch

from cache.offload import OffloadError, OffloadKey, TieredStore

DEFAULT_PIN_TTL_S = 120.0


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

    def contains(self, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds (one call for a whole prefix)."""
        return [key in self.store for key in keys]

    def stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.store.stats()) | {"pinned": len(self._pinned)}


class RayOffloadConnector:
    """The OffloadConnector of a replica whose store is an OffloadActor; picklable,
    so the scheduler actor and every rank actor hold one."""

    def __init__(self, actor: Any, layout_id: str) -> None:
        self.actor = actor
        self.layout_id = layout_id

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Any | None]:
        return ray.get(self.actor.lookup.remote(list(keys)))

    def fetch(self, handle: Any) -> torch.Tensor:
        return ray.get(self.actor.take.remote(handle))

    def publish(self, key: OffloadKey, rows: torch.Tensor) -> None:
        # Fire and forget: the rows are serialised into the call now; a lookup that
        # arrives before the put lands is a miss, which only costs a recompute.
        self.actor.put.remote(key, rows)
