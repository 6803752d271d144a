"""Single-pass manifold hyper-connections (mHC) with Sinkhorn mixing.

Owns the residual of ``hc_mult`` streams per token: the per-site mix (pre, post and
the doubly stochastic comb matrix), the collapse of the streams into a sublayer input
(with the *previous* site's pre: single pass) and the expansion of a sublayer output
back into the streams (MODEL_FACTS section 3). Mixing runs in fp32.
A site's three steps (mix, collapse + RMSNorm, expand) run through ``HcKernels``: a
kernels backend may fuse each into a launch of its own, computing this module's
function; ``TorchHc`` is this module's arithmetic itself (the torch backend's, and the
default where no backend is given).
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dsv41.model.config import V41Config
from dsv41.model.linalg import linear, ordered_sum, pointwise, row_mean, small_sum, softmax
from dsv41.model.norm import rms_norm


@dataclass(frozen=True)
class HcMix:
    """One site's mixing coefficients for every token."""

    pre: torch.Tensor  # [T, hc] fp32: how the *next* site collapses the streams
    post: torch.Tensor  # [T, hc] fp32
    comb: torch.Tensor  # [T, hc_in, hc_out] fp32, doubly stochastic


@dataclass(frozen=True)
class HcSite:
    """One site's mixing weights (attention or FFN site of a block)."""

    fn: torch.Tensor  # [(2 + hc) * hc, hc * hidden] fp32
    base: torch.Tensor  # [(2 + hc) * hc] fp32
    scale: torch.Tensor  # [3] fp32

    def mix(self, streams: torch.Tensor, config: V41Config) -> "HcMix":
        return hc_mix(
            streams,
            self.fn,
            self.base,
            self.scale,
            sinkhorn_iters=config.hc_sinkhorn_iters,
            hc_eps=config.hc_eps,
            norm_eps=config.rms_norm_eps,
        )


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over the last dim (+eps), divide by column sums (+eps), then
    ``iters - 1`` rounds of row- then column-normalisation."""
    m = softmax(logits.float()) + eps
    m = m / (small_sum(m, -2) + eps)
    for _ in range(iters - 1):
        m = m / (small_sum(m, -1) + eps)
        m = m / (small_sum(m, -2) + eps)
    return m


def hc_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> HcMix:
    """The site function: streams [T, hc, hidden] -> (pre, post, comb)."""
    tokens, hc, _ = streams.shape
    flat = streams.reshape(tokens, -1).float()
    m = linear(flat, fn.float()) * torch.rsqrt(row_mean(flat.pow(2), keepdim=True) + norm_eps)
    s = scale.float()
    scales = torch.cat((s[0].expand(hc), s[1].expand(hc), s[2].expand(hc * hc)))
    logits = base.float() + m * scales
    pre = pointwise(torch.sigmoid, logits[:, :hc]) + hc_eps
    post = 2 * pointwise(torch.sigmoid, logits[:, hc : 2 * hc])
    comb = sinkhorn(logits[:, 2 * hc :].reshape(tokens, hc, hc), sinkhorn_iters, hc_eps)
    return HcMix(pre=pre, post=post, comb=comb)


def first_pre(tokens: int, hc: int, device: torch.device | None = None) -> torch.Tensor:
    """The first collapse weight: one-hot on stream 0."""
    pre = torch.zeros(tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = sum_i pre[i] * streams[i] (streams in order), kept in fp32 for the RMSNorm
    that follows."""
    return ordered_sum(pre[:, i : i + 1] * streams[:, i].float() for i in range(streams.shape[1]))


def expand(streams: torch.Tensor, y: torch.Tensor, mix: HcMix) -> torch.Tensor:
    """streams'[o] = post[o] * y + sum_i comb[i, o] * streams[i]."""
    out = mix.post.unsqueeze(-1) * y.float().unsqueeze(1)
    streams_f = streams.float()
    mixed = ordered_sum(mix.comb[:, i, :, None] * streams_f[:, i, None, :] for i in range(streams.shape[1]))
    out = out + mixed
    return out.to(streams.dtype)


class HcKernels(Protocol):
    """A site's steps as a kernels backend runs them. Each computes, for every row
    alone, the function of this module it names."""

    def hc_mix(self, streams: torch.Tensor, site: HcSite, config: V41Config) -> HcMix:
        """``site.mix(streams, config)``."""
        ...

    def hc_collapse_norm(
        self, streams: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """``rms_norm(collapse(streams, pre), norm, eps, out_dtype=out_dtype)``."""
        ...

    def hc_expand(self, streams: torch.Tensor, y: torch.Tensor, mix: HcMix) -> torch.Tensor:
        """``expand(streams, y, mix)``."""
        ...


class TorchHc:
    """``HcKernels`` as this module's own arithmetic."""

    def hc_mix(self, streams: torch.Tensor, site: HcSite, config: V41Config) -> HcMix:
        return site.mix(streams, config)

    def hc_collapse_norm(
        self, streams: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> torch.Tensor:
        return rms_norm(collapse(streams, pre), norm, eps, out_dtype=out_dtype)

    def hc_expand(self, streams: torch.Tensor, y: torch.Tensor, mix: HcMix) -> torch.Tensor:
        return expand(streams, y, mix)


TORCH_HC = TorchHc()


def run_site(
    streams: torch.Tensor,
    pre: torch.Tensor,
    site: HcSite,
    norm: torch.Tensor,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    config: V41Config,
    kernels: HcKernels = TORCH_HC,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One site of a block: mix from the incoming streams, collapse them with the
    previous site's ``pre``, RMSNorm, the sublayer, expand. Returns the new streams
    and this site's pre (what the next site collapses with)."""
    mix, h = open_site(streams, pre, site, norm, config, kernels)
    return kernels.hc_expand(streams, sublayer(h), mix), mix.pre


def open_site(
    streams: torch.Tensor,
    pre: torch.Tensor,
    site: HcSite,
    norm: torch.Tensor,
    config: V41Config,
    kernels: HcKernels = TORCH_HC,
) -> tuple[HcMix, torch.Tensor]:
    """A site up to its sublayer: its mix and the sublayer's input (``run_site`` for a
    sublayer that returns later: a MoE whose collectives are in flight). The site
    ends with ``kernels.hc_expand(streams, y, mix)`` and ``mix.pre``."""
    return kernels.hc_mix(streams, site, config), site_input(streams, pre, norm, config.rms_norm_eps, kernels)


def site_input(
    streams: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float, kernels: HcKernels = TORCH_HC
) -> torch.Tensor:
    """What a site's sublayer reads: the streams collapsed with the previous site's
    ``pre``, RMS-normed with the site's weight, in the streams' dtype. Row by row, so
    a subset of rows gives those rows' inputs (a bounded replay's KV source compresses
    every row's while its attention reads the tail's)."""
    return kernels.hc_collapse_norm(streams, pre, norm, eps, streams.dtype)


def final_hidden(
    streams: torch.Tensor, pre: torch.Tensor, norm: torch.Tensor, eps: float, kernels: HcKernels = TORCH_HC
) -> torch.Tensor:
    """After the last block: collapse with the last FFN-site pre, then the final norm
    (fp32, what the fp32 head reads)."""
    return kernels.hc_collapse_norm(streams, pre, norm, eps, torch.float32)
