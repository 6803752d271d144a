"""RMSNorm as DeepSeek-V4.1 computes it: ``w * x * rsqrt(mean(x^2) + eps)`` in fp32.

Owns the one normalisation every site uses (attention/FFN sites, q/kv norms, the
compressor and index-key norms, the final norm). Must not import: cache, cluster,
actors, deploy, ray.
"""

from __future__ import annotations

import torch

from dsv41.model.linalg import row_mean


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Normalises the last dim in fp32; returns ``out_dtype`` (default: x's dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(row_mean(xf.pow(2), keepdim=True) + eps) * weight.float()
    return y.to(out_dtype or x.dtype)
