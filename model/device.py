"""Moving a record of tensors to a device.

Owns one function that walks frozen dataclasses, mappings and tuples and moves every
tensor it meets, leaving objects that must stay where they are (host-memory Engram
tables) untouched. Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def move_tensors(obj: T, device: torch.device | str, *, keep: tuple[type, ...] = ()) -> T:
    """A copy of ``obj`` with every tensor on ``device``; instances of ``keep`` (and
    anything that is not a tensor, dataclass, mapping, tuple or list) are shared."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)  # type: ignore[return-value]
    if keep and isinstance(obj, keep):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes: dict[str, Any] = {
            f.name: move_tensors(getattr(obj, f.name), device, keep=keep) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: move_tensors(v, device, keep=keep) for k, v in obj.items()}  # type: ignore[return-value]
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_tensors(v, device, keep=keep) for v in obj)  # type: ignore[return-value]
    return obj
