"""Kernel backends of the paged hot paths, chosen explicitly.

Owns the choice: ``"torch"`` (the reference; runs anywhere), ``"triton"`` (NVIDIA GPUs,
or CPUs under TRITON_INTERPRET=1), ``"aiter"`` (AMD ROCm, used only when the aiter
package imports: it is never a dependency). An unavailable backend is an error, never a
silent switch; the choice is logged. Also the one place that installs model/linalg.py's
GPU GEMM and row reduction (``register_gpu_linalg_kernels``), which every backend's
arithmetic runs on a GPU in the batch-invariant mode and for FP8 weights as stored.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from dsv41.model.kernels.interface import PagedKernels

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("torch", "triton", "aiter")


class KernelBackendError(ValueError):
    """A kernel backend that is unknown or cannot run here."""


def register_gpu_linalg_kernels(device: torch.device | str) -> None:
    """On a CUDA device, installs the Triton GEMM and row reduction that model/linalg.py
    runs there in the batch-invariant mode, and for every projection through an FP8
    weight as stored, whatever the paged kernels backend (the torch backend's
    projections and attention products run them too); elsewhere nothing."""
    if torch.device(device).type != "cuda":
        return
    if importlib.util.find_spec("triton") is None:
        raise KernelBackendError(
            "a GPU engine's batch-invariant mode and its FP8 weights as stored run Triton's fixed-tile GEMM and "
            "row reduction, and the triton package is missing (pip install 'dsv41[gpu]')"
        )
    import dsv41.model.kernels.triton  # noqa: F401  (registers them on import)


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
