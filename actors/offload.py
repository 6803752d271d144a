"""OffloadActor: one node's tiered store of PAGE units and STATE images, served to
ranks on any node through the Ray object store.

Owns the actor around ``cache.offload.TieredStore``: ranks publish units with the
rows in a ``ray.put`` reference (resolved into the actor's object store copy) and
look them up by key; what ``get`` returns travels back through the object store.

Must not import: deploy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from cache.offload import OffloadKey, TieredStore


class OffloadActor:
    """A node's offload store; create with ``ray.remote(OffloadActor)``."""

    def __init__(
        self,
        layout_id: str,
        page_bytes: int,
        host_budget_bytes: int,
        disk_dir: str | None = None,
        disk_budget_bytes: int = 0,
    ) -> None:
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

    def contains(self, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds (one call for a whole prefix)."""
        return [key in self.store for key in keys]

    def stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.store.stats())
