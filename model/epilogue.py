"""A projection's epilogue: the RMSNorm, RoPE and fake quantisation of its output rows.

Owns ``Epilogue``, what one site runs on a projection's output, in this order, each
step optional: an RMSNorm over the last dim (model/norm.py), the rotation of the last
``rope_dim`` channels at each row's position, forward or inverse (model/rope.py), a
rounding to FP8 E4M3 or MXFP4 in blocks of 32 channels (model/formats.py), then the
output dtype. Every step before the last computes in fp32, as the sites compose them
(the q latent, the query and index query, the window KV, the output's inverse rotation,
the compressor's latent and index keys). ``apply_epilogue`` is that composition itself;
``EpilogueKernels`` is the protocol a kernels backend implements (it may fuse a site
into one launch, computing this module's function row by row), and
``TorchEpilogue`` is this module's arithmetic (the torch backend's, and the default
where no backend is given: the dense reference).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dsv41.model.formats import FP8_BLOCK, MXFP4_BLOCK, round_fp8, round_mxfp4
from dsv41.model.norm import rms_norm
from dsv41.model.rope import Rope

# The grids an epilogue rounds to, and the channels one scale covers in each.
EPILOGUE_ROUNDINGS = {"fp8": FP8_BLOCK, "mxfp4": MXFP4_BLOCK}
EPILOGUE_OUT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Epilogue:
    """One site's steps after its projection: ``norm`` (the RMSNorm weight over the last
    dim, with ``eps``), ``rope`` (``inverse``: the conjugate rotation), ``round_to`` (a
    key of EPILOGUE_ROUNDINGS), and the dtype of the result."""

    out_dtype: torch.dtype
    norm: torch.Tensor | None = None
    eps: float = 0.0
    rope: Rope | None = None
    inverse: bool = False
    round_to: str | None = None

    def __post_init__(self) -> None:
        if self.out_dtype not in EPILOGUE_OUT_DTYPES:
            allowed = ", ".join(map(str, EPILOGUE_OUT_DTYPES))
            raise ValueError(f"Epilogue.out_dtype: {self.out_dtype} (allowed: {allowed})")
        if self.norm is not None and (self.norm.dim() != 1 or not self.eps > 0):
            raise ValueError(
                f"Epilogue.norm: shape {tuple(self.norm.shape)} with eps {self.eps} (allowed: a [D] weight, eps > 0)"
            )
        if self.inverse and self.rope is None:
            raise ValueError("Epilogue.inverse: True without a rope (allowed: False)")
        if self.round_to is not None and self.round_to not in EPILOGUE_ROUNDINGS:
            raise ValueError(f"Epilogue.round_to: {self.round_to!r} (allowed: None, {', '.join(EPILOGUE_ROUNDINGS)})")


def check_epilogue(x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None) -> None:
    """Raises ValueError, naming the argument, unless ``apply_epilogue(x, spec,
    positions)`` is a call every backend computes alike: x [T, D] or [T, H, D], a
    norm of D channels, positions [T] for a rope of at most D channels, D a multiple of
    the rounding's block."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x: shape {tuple(x.shape)} (allowed: [T, D] or [T, H, D])")
    width = x.shape[-1]
    if spec.norm is not None and spec.norm.shape[0] != width:
        raise ValueError(f"spec.norm: {spec.norm.shape[0]} channels for rows of {width}")
    if spec.rope is not None:
        if positions is None or positions.shape != x.shape[:1]:
            shape = None if positions is None else tuple(positions.shape)
            raise ValueError(f"positions: {shape} for x {tuple(x.shape)} (allowed: [{x.shape[0]}])")
        if spec.rope.rope_dim > width or spec.rope.rope_dim % 2:
            raise ValueError(f"spec.rope: rope_dim {spec.rope.rope_dim} on rows of {width} (allowed: even, <= {width})")
    if spec.round_to is not None and width % EPILOGUE_ROUNDINGS[spec.round_to]:
        block = EPILOGUE_ROUNDINGS[spec.round_to]
        raise ValueError(f"x: width {width} is not a multiple of {spec.round_to}'s block {block}")


def apply_epilogue(x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The site's function: norm, rope and rounding in fp32 on x [T, D] or [T, H, D]
    (positions [T]: each row's, shared by its heads), then ``spec.out_dtype``."""
    check_epilogue(x, spec, positions)
    y = rms_norm(x, spec.norm, spec.eps, out_dtype=torch.float32) if spec.norm is not None else x.float()
    if spec.rope is not None:
        y = spec.rope.apply(y, positions, inverse=spec.inverse)
    # The roundings are looked up here when called: training's straight-through
    # estimator patches them in this module (model/training.py).
    if spec.round_to == "fp8":
        y = round_fp8(y)
    elif spec.round_to == "mxfp4":
        y = round_mxfp4(y)
    return y.to(spec.out_dtype)


class EpilogueKernels(Protocol):
    """A site's epilogue as a kernels backend runs it: every row (and head) alone, so a
    row's result does not depend on the other rows of the call."""

    def epilogue(self, x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``apply_epilogue(x, spec, positions)``."""
        ...


class TorchEpilogue:
    """``EpilogueKernels`` as this module's own arithmetic."""

    def epilogue(self, x: torch.Tensor, spec: Epilogue, positions: torch.Tensor | None = None) -> torch.Tensor:
        return apply_epilogue(x, spec, positions)


TORCH_EPILOGUE = TorchEpilogue()
