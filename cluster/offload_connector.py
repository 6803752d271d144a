"""How a replica reaches its offload store of PAGE units and STATE images.

Owns the ``OffloadConnector`` contract between the scheduler, the ranks and a store of
``cache.offload``: the scheduler ``lookup``s the keys of a prompt's PAGEs (and images)
on admission and gets a handle per unit the store holds, which pins the unit until the
rank ``fetch``es it; ranks ``publish`` every PAGE they complete and every image they
store, and do not wait for the store. ``LocalOffload`` is the in-process connector
over a ``TieredStore`` (its handles are the rows themselves); ``actors.offload`` has
the one over a Ray actor. Also the wire types a ScheduledSegment carries: ``PageFill``
(write fetched bytes into PAGEs before the forward) and ``PagePublish`` (send PAGEs'
bytes to the store after it).

Must not import: model, actors, deploy, ray.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from dsv41.cache.offload import OffloadKey, TieredStore


def _check_pages(owner: str, pages: tuple[int, ...]) -> None:
    if not pages or min(pages) < 0:
        raise ValueError(f"{owner}.pages: {pages} (allowed: at least one PAGE id >= 0)")


@dataclass(frozen=True)
class PageFill:
    """Write the unit behind ``handle`` (rows of ``len(pages)`` PAGEs) into ``pages``."""

    pages: tuple[int, ...]
    handle: Any

    def __post_init__(self) -> None:
        _check_pages("PageFill", self.pages)


@dataclass(frozen=True)
class PagePublish:
    """Send the bytes of ``pages`` (one PAGE, or an image's PAGEs) to the store as ``key``."""

    pages: tuple[int, ...]
    key: OffloadKey

    def __post_init__(self) -> None:
        _check_pages("PagePublish", self.pages)


class OffloadConnector(Protocol):
    """A replica's side of one offload store (of one ``layout_id``)."""

    layout_id: str

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Any | None]:
        """A handle per key the store holds (None where it does not), pinning the
        unit until fetched or dropped."""
        ...

    def fetch(self, handle: Any) -> torch.Tensor:
        """The unit's rows, uint8 [PAGEs, page_bytes]."""
        ...

    def publish(self, key: OffloadKey, rows: torch.Tensor) -> None:
        """Stores ``rows`` (a copy is taken before this returns) without waiting."""
        ...


class LocalOffload:
    """An OffloadConnector over a TieredStore in this process, shared by the ranks
    of a replica (a lock, since threaded ranks publish at once)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.layout_id = store.layout_id
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[OffloadKey]) -> list[Any | None]:
        with self._lock:
            return [self.store.get(key) if key in self.store else None for key in keys]

    def fetch(self, handle: Any) -> torch.Tensor:
        return handle

    def publish(self, key: OffloadKey, rows: torch.Tensor) -> None:
        with self._lock:
            self.store.put(key, rows)
