"""Kernel backends of the paged hot paths, chosen explicitly.

Owns the choice: ``"torch"`` (the reference; runs anywhere), ``"triton"`` (NVIDIA GPUs,
or CPUs under TRITON_INTERPRET=1), ``"aiter"`` (AMD ROCm, used only when the aiter
package imports: it is never a dependency). An unavailable backend is an error, never a
silent switch; the choice is logged.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import importlib.util
import logging

from dsv41.model.kernels.interface import PagedKernels

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("torch", "triton", "aiter")


class KernelBackendError(ValueError):
    """A kernel backend that is unknown or cannot run here."""


def load_kernels(name: str) -> PagedKernels:
    if name == "torch":
        from dsv41.model.kernels.torch_backend import TorchKernels

        kernels: PagedKernels = TorchKernels()
    elif name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise KernelBackendError("kernel_backend: 'triton' needs the triton package (pip install 'dsv41[gpu]')")
        from dsv41.model.kernels.triton import TritonKernels

        kernels = TritonKernels()
    elif name == "aiter":
        raise KernelBackendError(
            "kernel_backend: 'aiter' is AMD ROCm's kernel library; no aiter kernels are wired in this build "
            "(allowed here: 'torch', 'triton')"
        )
    else:
        raise KernelBackendError(f"kernel_backend: {name!r} (allowed: {', '.join(KERNEL_BACKENDS)})")
    logger.info("paged kernels: %s backend", kernels.name)
    return kernels
