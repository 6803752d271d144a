"""Tiered store of offloaded PAGE units and STATE checkpoint images (lmcache-style).

Owns: bytes kept outside a rank's pools, keyed by (layout_id, chain hash, kind): a
PAGE unit is one PAGE's byte row, an image the byte rows of the PAGEs a checkpoint
image occupies, so a restore writes back exactly what a local hit would read. A host
memory tier, least recently used first out under a byte budget, spills to an optional
disk tier (also LRU under a budget); a disk hit moves back to host memory. The store
serves one layout: a key or unit of any other layout_id is refused, since its bytes
mean something else under these pools.

Must not import: anything of this project, the scheduler, ray.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch


class OffloadError(ValueError):
    """A unit or key the store refuses; the message names the field."""


class UnitKind(enum.Enum):
    PAGE = "page"
    IMAGE = "image"


@dataclass(frozen=True)
class OffloadKey:
    layout_id: str
    chain_hash: bytes
    kind: UnitKind

    def __post_init__(self) -> None:
        if not self.layout_id:
            raise OffloadError("OffloadKey.layout_id: empty (allowed: a geometry's layout_id)")
        if not isinstance(self.chain_hash, bytes) or not self.chain_hash:
            raise OffloadError(f"OffloadKey.chain_hash: {self.chain_hash!r} (allowed: a non-empty prefix hash)")
        if not isinstance(self.kind, UnitKind):
            raise OffloadError(f"OffloadKey.kind: {self.kind!r} (allowed: UnitKind.PAGE, UnitKind.IMAGE)")

    @property
    def file_name(self) -> str:
        return f"{self.kind.value}-{self.chain_hash.hex()}.bin"


@dataclass(frozen=True)
class OffloadStats:
    host_units: int
    host_bytes: int
    disk_units: int
    disk_bytes: int
    puts: int
    hits: int
    disk_hits: int
    misses: int
    evictions: int  # units dropped from the last tier


class TieredStore:
    """PAGE units and images of one layout in host memory, then on disk."""

    def __init__(
        self,
        layout_id: str,
        page_bytes: int,
        host_budget_bytes: int,
        *,
        disk_dir: str | Path | None = None,
        disk_budget_bytes: int = 0,
    ) -> None:
        if not layout_id:
            raise OffloadError("layout_id: empty (allowed: the pools' layout_id)")
        for name, value in (("page_bytes", page_bytes), ("host_budget_bytes", host_budget_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise OffloadError(f"{name}: {value!r} (allowed: a positive integer)")
        if (disk_dir is None) != (disk_budget_bytes == 0) or disk_budget_bytes < 0:
            raise OffloadError(
                f"disk_dir / disk_budget_bytes: {disk_dir!r} / {disk_budget_bytes} (allowed: both set, or neither)"
            )
        self.layout_id = layout_id
        self.page_bytes = page_bytes
        self.host_budget_bytes = host_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._host: OrderedDict[OffloadKey, torch.Tensor] = OrderedDict()
        self._disk: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> rows on disk
        self._host_bytes = 0
        self._disk_bytes = 0
        self._puts = self._hits = self._disk_hits = self._misses = self._evictions = 0

    def put(self, key: OffloadKey, rows: torch.Tensor) -> None:
        """Stores ``rows`` (uint8 ``[n, page_bytes]``: one PAGE, or an image's PAGEs)
        as the most recently used unit, replacing an older copy."""
        self._check_key(key)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.page_bytes or not rows.shape[0]:
            raise OffloadError(
                f"rows: {rows.dtype} {tuple(rows.shape)} (allowed: uint8 [n >= 1, page_bytes={self.page_bytes}])"
            )
        if key.kind is UnitKind.PAGE and rows.shape[0] != 1:
            raise OffloadError(f"rows: {rows.shape[0]} PAGEs for a PAGE unit (allowed: 1)")
        if rows.numel() > self.host_budget_bytes:
            raise OffloadError(f"rows: {rows.numel()} bytes exceed host_budget_bytes={self.host_budget_bytes}")
        self._drop(key)
        self._host[key] = rows.detach().to("cpu", copy=True).contiguous()
        self._host_bytes += rows.numel()
        self._puts += 1
        self._fit_host()

    def get(self, key: OffloadKey) -> torch.Tensor | None:
        """The unit's rows (most recently used afterwards), or None."""
        self._check_key(key)
        rows = self._host.get(key)
        if rows is not None:
            self._host.move_to_end(key)
            self._hits += 1
            return rows
        if key in self._disk and self.disk_dir is not None:
            num_rows = self._disk.pop(key)
            path = self.disk_dir / key.file_name
            rows = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).view(num_rows, self.page_bytes)
            path.unlink()
            self._disk_bytes -= rows.numel()
            self._host[key] = rows
            self._host_bytes += rows.numel()
            self._fit_host()
            self._hits += 1
            self._disk_hits += 1
            return rows
        self._misses += 1
        return None

    def __contains__(self, key: OffloadKey) -> bool:
        return key in self._host or key in self._disk

    def stats(self) -> OffloadStats:
        return OffloadStats(
            host_units=len(self._host),
            host_bytes=self._host_bytes,
            disk_units=len(self._disk),
            disk_bytes=self._disk_bytes,
            puts=self._puts,
            hits=self._hits,
            disk_hits=self._disk_hits,
            misses=self._misses,
            evictions=self._evictions,
        )

    # -- internals --------------------------------------------------------------------

    def _check_key(self, key: OffloadKey) -> None:
        if not isinstance(key, OffloadKey):
            raise OffloadError(f"key: {type(key).__name__} (allowed: OffloadKey)")
        if key.layout_id != self.layout_id:
            raise OffloadError(
                f"key.layout_id: {key.layout_id!r} (allowed: {self.layout_id!r}, the layout this store serves)"
            )

    def _drop(self, key: OffloadKey) -> None:
        rows = self._host.pop(key, None)
        if rows is not None:
            self._host_bytes -= rows.numel()
        if key in self._disk and self.disk_dir is not None:
            self._disk_bytes -= self._disk.pop(key) * self.page_bytes
            (self.disk_dir / key.file_name).unlink()

    def _fit_host(self) -> None:
        while self._host_bytes > self.host_budget_bytes:
            key, rows = self._host.popitem(last=False)
            self._host_bytes -= rows.numel()
            if self.disk_dir is None or rows.numel() > self.disk_budget_bytes:
                self._evictions += 1
                continue
            (self.disk_dir / key.file_name).write_bytes(rows.numpy().tobytes())
            self._disk[key] = rows.shape[0]
            self._disk_bytes += rows.numel()
            self._fit_disk()

    def _fit_disk(self) -> None:
        while self._disk_bytes > self.disk_budget_bytes and self.disk_dir is not None:
            key, num_rows = self._disk.popitem(last=False)
            (self.disk_dir / key.file_name).unlink()
            self._disk_bytes -= num_rows * self.page_bytes
            self._evictions += 1
