"""The reference-slice engine that bench/decode_step.py and bench/prefill.py run.

Owns what the two benchmarks share: their command-line options, building the slice
(model/reference_slice.py: weights generated on the device, no checkpoint written)
with progress output, an in-process Engine over it whose pools hold the workload, the
run's environment record, and the issue's figures for a transformers-style eager
implementation of V4.1 on the same slice and card. Imports cluster/ and model/.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import platform
import time
from datetime import datetime, timezone
from typing import Callable

import torch

from dsv41.cache.pools import PoolSize
from dsv41.cluster.engine import Engine
from dsv41.cluster.cuda_graphs import CUDAGRAPH_MODES
from dsv41.cluster.options import EngineOptions, RankLayout
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config
from dsv41.model.loader import WEIGHT_STORAGE, LoadedCheckpoint
from dsv41.model.params import ModelParams
from dsv41.model.reference_slice import (
    DENSE_FORMATS,
    EXPERT_FORMATS,
    REFERENCE_SLICE,
    SMALL_SLICE,
    GenerationProgress,
    SliceModel,
    load_slice,
)
from dsv41.model.weights import checkpoint_tensors

FLASH = FLASH_CONFIG_DIR

# The GPU issue's measurements of a straightforward transformers-style eager V4.1 on
# the reference slice and an H200 (bf16 random weights): decode output tokens/s by
# batch (1024-token prompts) and prefill tokens/s of one 4096-token prompt, each with
# how many times its floor it took. Quoted, not measured here.
EAGER_DECODE_TOK_PER_S = {1: 10.9, 8: 49.1, 32: 123.5}
EAGER_DECODE_X_FLOOR = {1: 48.0, 8: 27.0, 32: 27.0}
EAGER_PREFILL_TOK_PER_S = 6412.0
EAGER_PREFILL_X_FLOOR = 14.0


def add_slice_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--small", action="store_true",
        help="the slice's layer roles at CPU widths (model.reference_slice.SMALL_SLICE), small workload; "
        "defaults to the CPU and the torch backend",
    )
    parser.add_argument("--device", default=None, help="default: cuda when present (cpu with --small)")
    parser.add_argument(
        "--kernel-backend", default=None, choices=("torch", "triton"), help="default: triton on CUDA, else torch"
    )
    parser.add_argument("--experts", default="bf16", choices=EXPERT_FORMATS, help="routed expert storage")
    parser.add_argument(
        "--dense", default="bf16", choices=DENSE_FORMATS,
        help="storage of the FP8 kinds (attention projections, shared experts, indexer wq_b, Engram wkv)",
    )
    parser.add_argument(
        "--weight-storage", default="decoded", choices=WEIGHT_STORAGE,
        help="stored: FP8 / FP4 weights stay in their stored bytes on the device; decoded: bf16",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights seed")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="the engine's batch-invariant mode (default: the engine's, on for the CPU, off on a GPU)",
    )
    parser.add_argument(
        "--cudagraph-mode", default="none", choices=CUDAGRAPH_MODES,
        help="the engine's cudagraph_mode (full: decode steps replayed from CUDA graphs, Triton kernels on CUDA)",
    )
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
        help="the engine's async_scheduling (the next step scheduled and launched while the previous one runs)",
    )
    parser.add_argument(
        "--fp8-activations", action="store_true",
        help="the engine's fp8_activations: the FP8-weight projections quantise their inputs to FP8 per token and 32 "
        "channels (the rounded rows through the usual GEMMs); needs --dense fp8 --weight-storage stored",
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads on the CPU (default 1: on a shared box more threads spin against each other)",
    )


def resolve_device(args: argparse.Namespace) -> tuple[str, str]:
    """(device, kernel backend) from the options and what is present."""
    device = args.device or ("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    backend = args.kernel_backend or ("triton" if torch.device(device).type == "cuda" else "torch")
    return device, backend


def prepare_device(args: argparse.Namespace) -> str:
    """The run's device, with torch's CPU threads set before anything is measured."""
    device, _ = resolve_device(args)
    if torch.device(device).type == "cpu":
        torch.set_num_threads(args.threads or 1)
    return device


def generate_slice(args: argparse.Namespace, weight_storage: str | None = None) -> LoadedCheckpoint:
    """The slice's weights made on ``args.device`` and post-load processed there, with
    ``weight_storage`` (default: ``args.weight_storage``)."""
    device, _ = resolve_device(args)
    storage = weight_storage or args.weight_storage
    spec = SMALL_SLICE if args.small else REFERENCE_SLICE
    model = SliceModel.build(spec, V41Config.from_pretrained(FLASH, text_only=True), expert_format=args.experts)
    total = len(checkpoint_tensors(model.config))
    print(
        f"generating {spec.name} ({args.experts} experts, {args.dense} dense weights, {storage}, "
        f"seed {args.seed}) on {device}: {total} tensors",
        flush=True,
    )
    began = time.monotonic()
    checkpoint = load_slice(
        model,
        seed=args.seed,
        dtype=torch.bfloat16,
        device=device,
        weight_storage=storage,
        dense_format=args.dense,
        progress=_generation_reporter(total),
    )
    print(f"weights generated and post-load processed in {time.monotonic() - began:.1f} s", flush=True)
    return checkpoint


def build_slice_engine(
    args: argparse.Namespace,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tokens_per_request: int,
    decoder_replay: bool = False,
    graph_batch_sizes: tuple[int, ...] | None = None,
    checkpoint: LoadedCheckpoint | None = None,
    fp8_activations: bool | None = None,
) -> Engine:
    """The slice (bf16 compute) in an in-process engine on ``args.device`` whose pools
    hold ``max_num_seqs`` requests of ``tokens_per_request`` tokens each (its context
    limit); prefix caching is off (random prompts share nothing); ``decoder_replay``:
    the engine's decoder_swa_bounded_replay; under ``--cudagraph-mode full`` the batch
    buckets captured are ``graph_batch_sizes`` (None: the engine's default);
    ``checkpoint``: these weights (generate_slice's), not newly generated ones;
    ``fp8_activations``: the engine's (None: ``--fp8-activations``)."""
    device, backend = resolve_device(args)
    checkpoint = checkpoint or generate_slice(args)
    params = ModelParams.from_checkpoint(checkpoint)
    options = EngineOptions(
        dtype=torch.bfloat16,
        max_num_seqs=max_num_seqs,
        num_state_slots=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        # No per-request prefill cap: a prefill bench times one forward of the whole prompt.
        long_prefill_token_threshold=0,
        block_size=args.block_size,
        enable_prefix_caching=False,
        weight_storage=checkpoint.weight_storage,
        kernel_backend=backend,
        device=device,
        batch_invariant=args.batch_invariant,
        decoder_swa_bounded_replay=decoder_replay,
        max_model_len=tokens_per_request,
        cudagraph_mode=args.cudagraph_mode,
        cudagraph_batch_sizes=graph_batch_sizes if args.cudagraph_mode != "none" else None,
        async_scheduling=args.async_scheduling,
        fp8_activations=args.fp8_activations if fp8_activations is None else fp8_activations,
    )
    geometry = RankLayout.build(params.config, options).geometry
    # One page more than the requests need: the sizing must never be what preempts.
    num_pages = max_num_seqs * -(-tokens_per_request // options.block_size) + 1
    budget = PoolSize(num_pages=num_pages, num_slots=max_num_seqs).nbytes(geometry)
    options = dataclasses.replace(options, num_pages=num_pages, cache_memory_bytes=budget)
    engine = Engine.from_params(params, checkpoint.tokenizer, options)
    print(
        f"engine: {backend} kernels on {device}, {num_pages} PAGEs x {options.block_size} tokens, "
        f"{max_num_seqs} STATE slots, pools {budget / 2**30:.2f} GiB",
        flush=True,
    )
    return engine


def _generation_reporter(total: int) -> Callable[[GenerationProgress], None]:
    """Prints a line per layer (and for the embedding, head and norm) as it is made."""
    last_group: list[str] = []

    def report(progress: GenerationProgress) -> None:
        parts = progress.tensor.split(".")
        group = ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
        if last_group and group == last_group[0] and progress.tensors_made < total:
            return
        last_group[:] = [group]
        print(
            f"  {progress.tensors_made:5d}/{total} tensors, {progress.bytes_made / 1e9:6.2f} GB, "
            f"{progress.seconds:6.1f} s  ({group})",
            flush=True,
        )

    return report


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly past the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab_size, (count, length), generator=g).tolist()


def start_decoding(
    engine: Engine,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    warmup: int,
    on_prefill_step: Callable[[int], None] | None = None,
) -> None:
    """Adds ``prompts`` (request id -> token ids), steps until every prompt is
    prefilled (``on_prefill_step``: called after each step with the prompt tokens done),
    then ``warmup`` decode steps: the engine is then decoding all of them."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
        if on_prefill_step is not None:
            on_prefill_step(sum(min(r.num_computed_tokens, r.num_prompt_tokens) for r in scheduler.running))
    for _ in range(warmup):
        engine.step()


def environment(args: argparse.Namespace, engine: Engine, ceilings: dict[str, float]) -> dict[str, object]:
    """What a result depends on besides its numbers."""
    device, backend = resolve_device(args)
    where = torch.device(device)
    try:
        triton_version: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.platform(),
        "device": torch.cuda.get_device_name(where) if where.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "torch_threads": torch.get_num_threads(),
        "slice": (SMALL_SLICE if args.small else REFERENCE_SLICE).name,
        "experts": args.experts,
        "dense": args.dense,
        "weight_storage": args.weight_storage,
        "seed": args.seed,
        "kernel_backend": backend,
        "batch_invariant": engine.options.batch_invariant,
        "cudagraph_mode": engine.options.cudagraph_mode,
        "async_scheduling": engine.options.async_scheduling,
        "fp8_activations": engine.options.fp8_activations,
        "block_size": engine.options.block_size,
        "kv_cache_dtype": engine.options.kv_cache_dtype,
        "index_cache_dtype": engine.options.index_cache_dtype,
        "ceilings": ceilings,
    }
