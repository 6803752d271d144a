"""Decode steps of the reference slice against their bytes-moved floor.

The real engine path (Engine, ModelRunner, paged runtime, the chosen kernel backend)
on the reference slice of V4.1-Flash (model/reference_slice.py; bf16 random weights,
or FP4 routed experts), generated on the device. For each batch size, that many
random prompts are prefilled, then whole decode steps (scheduling, addresses, Engram
lookup on the host, forward, sampling) are timed: ms per step and output tokens/s.
The floor is the bytes a step must read over the copy bandwidth measured in the same
run: every dense weight (each layer's non-routed weights, the final norm, the fp32
head, the batch's embedding rows), the routed experts the batch actually routes to
(distinct per layer, counted on extra steps), and the cache rows each request reads
(its window ring rows, its selected compressed rows, the index entries it scores).
Engram table rows live in host memory and are left out.

Prints a table and writes JSON. On the GPU machine, from the repo root:
    python3 -m bench.decode_step [--experts fp4]
On a CPU (the slice's layer roles at small widths, torch backend, in seconds):
    python3 -m bench.decode_step --small
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import torch


from bench.ceilings import ceilings, describe_ceilings
from bench.slice_engine import (
    EAGER_DECODE_TOK_PER_S,
    EAGER_DECODE_X_FLOOR,
    add_slice_options,
    build_slice_engine,
    environment,
    prepare_device,
    random_prompts,
    start_decoding,
)
from dsv41.cache.geometry import PlaneKind, PlaneSpec, V41PoolGeometry
from dsv41.cluster.engine import Engine
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.config import LayerMode, V41Config
from dsv41.model.moe import route
from dsv41.model.params import LayerParams

# Issue 17's targets: a decode step within this multiple of its floor, by batch.
TARGET_X_FLOOR = {1: 3.0, 32: 1.5, 128: 1.5}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Batch sizes, each prefilling that many ``prompt_len``-token prompts (chunks of
    ``max_num_batched_tokens``), then untimed warm-up steps, timed steps, and steps
    that count the routed experts."""

    batches: tuple[int, ...]
    prompt_len: int
    warmup_steps: int
    timed_steps: int
    counting_steps: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError(f"Workload.batches: {self.batches} (allowed: positive batch sizes)")
        for name in ("prompt_len", "timed_steps", "counting_steps", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Workload.{name}: {getattr(self, name)} (allowed: a positive int)")
        if self.warmup_steps < 0:
            raise ValueError(f"Workload.warmup_steps: {self.warmup_steps} (allowed: >= 0)")

    def max_tokens(self, batch: int) -> int:
        """Output tokens a request of ``batch`` must be allowed so that none finishes
        before the counting steps end: one per step while later prompts prefill (their
        chunks share each step's budget with the decode rows, hence twice the chunk
        count), then one per warm-up, timed and counting step, and a margin."""
        prefill_steps = -(-batch * self.prompt_len // self.max_num_batched_tokens)
        return 2 * prefill_steps + self.warmup_steps + self.timed_steps + self.counting_steps + 4


FULL_WORKLOAD = Workload((1, 8, 32, 128), 1024, 3, 16, 2, 16384)
SMALL_WORKLOAD = Workload((1, 4), 128, 1, 3, 1, 512)


def device_bytes(obj: object, device: torch.device) -> int:
    """Bytes of every tensor on ``device`` inside a record of dataclasses, mappings and
    tuples (host-resident Engram tables and RoPE tables do not count)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes if obj.device == device else 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(device_bytes(getattr(obj, f.name), device) for f in dataclasses.fields(obj))
    if isinstance(obj, Mapping):
        return sum(device_bytes(v, device) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(device_bytes(v, device) for v in obj)
    return 0


def _row_bytes(planes: tuple[PlaneSpec, ...], kinds: tuple[PlaneKind, ...], key: int, rows: int) -> float:
    return sum(p.nbytes for p in planes if p.kind in kinds and p.key == key) / rows


def cache_bytes_read(config: V41Config, geometry: V41PoolGeometry, position: int) -> float:
    """Cache bytes one decode row at ``position`` reads: in every layer its window's
    earlier rows from the ring (its own row comes from the step), and in compressed
    layers the selected main rows, plus every visible index entry where it scores."""
    window = config.sliding_window
    total = 0.0
    for layer in config.topology.target_layers:
        ring = _row_bytes(geometry.state_planes, (PlaneKind.SWA_RING, PlaneKind.SWA_SCALES), layer.layer_id,
                          geometry.ring_rows)
        total += min(position, window - 1) * ring
        if layer.mode is LayerMode.WINDOW:
            continue
        entries = (position + 1) // layer.ratio
        owner_rows = geometry.rows_per_page(layer.kv_owner)
        main = _row_bytes(geometry.page_planes, (PlaneKind.MAIN_KV, PlaneKind.MAIN_KV_SCALES), layer.kv_owner,
                          owner_rows)
        total += min(config.index_topk, entries) * main
        if layer.mode in (LayerMode.FULL, LayerMode.REINDEX):
            scored = entries
            if layer.uses_candidates:
                scored = min(entries, config.candidate_topk_blocks * config.candidate_block_size)
            index = _row_bytes(geometry.page_planes, (PlaneKind.INDEX_VALUES, PlaneKind.INDEX_SCALES),
                               layer.index_owner, geometry.rows_per_page(layer.index_owner))
            total += scored * index
    return total


def distinct_experts_per_step(engine: Engine, steps: int) -> float:
    """Runs ``steps`` decode steps with the MoE hook counting the distinct routed
    experts of every layer (routing recomputed by model/moe.route on the same rows);
    returns their sum over layers, averaged over the steps."""
    runtime = engine.runner.runtime
    config = engine.config
    original = runtime.moe
    counted: list[int] = []

    def counting(layer: LayerParams, h: torch.Tensor) -> torch.Tensor:
        routing = route(h, layer.moe.gate, layer.moe.bias, config.num_experts_per_tok, config.routed_scaling_factor)
        counted.append(int(routing.expert_ids.unique().numel()))
        return original(layer, h)

    # A replayed graph (a FULL decode step, or a TR_HYBRID part holding the MoE) never
    # calls the hook: count on eager steps.
    runner = engine.runner
    graphs, token_graphs = runner.graphs, runner.token_graphs
    runner.graphs = runner.token_graphs = None
    runtime.moe = counting
    try:
        for _ in range(steps):
            engine.step()
    finally:
        runtime.moe = original
        runner.graphs, runner.token_graphs = graphs, token_graphs
    return sum(counted) / steps


def decode_case(
    engine: Engine, batch: int, workload: Workload, ceil: dict[str, float], *, eager: bool
) -> dict[str, object]:
    """One batch size: prefill, warm-up, timed steps, expert counting; ``eager`` adds
    the issue's eager figures (they are for the reference slice alone)."""
    config = engine.config
    # Where the weights are, as their tensors name it ("cuda:0", not the option's "cuda").
    device = engine.params.embed.device
    params = SamplingParams(max_tokens=workload.max_tokens(batch), temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    began = time.perf_counter()
    total_prompt = batch * workload.prompt_len

    def report(done: int) -> None:
        print(f"  batch {batch}: prefilled {done}/{total_prompt} prompt tokens, {time.perf_counter() - began:.1f} s",
              flush=True)

    prompts = random_prompts(batch, workload.prompt_len, config.vocab_size, seed=batch)
    start_decoding(engine, dict(zip(ids, prompts)), params, workload.warmup_steps, on_prefill_step=report)
    positions = [engine.request(rid).num_tokens - 1 for rid in ids]
    step_s = []
    for _ in range(workload.timed_steps):
        started = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - started)
        if len(outputs) != batch:
            raise RuntimeError(f"batch {batch}: a decode step produced {len(outputs)} tokens (expected {batch})")
    distinct = distinct_experts_per_step(engine, workload.counting_steps)
    for rid in ids:
        engine.abort(rid)

    weights = engine.params
    routed = [device_bytes(w, device) for layer in weights.layers for w in layer.moe.experts.values()]
    # Every weight on the device is read each step except the embedding (the batch's
    # rows only) and the routed experts (those routed to only).
    dense = device_bytes(weights, device) - sum(routed) - weights.embed.nbytes + batch * weights.embed[0].nbytes
    experts = distinct * statistics.mean(routed)
    cache = sum(
        cache_bytes_read(config, engine.geometry, p + k) for p in positions for k in range(workload.timed_steps)
    ) / workload.timed_steps
    floor_s = (dense + experts + cache) / ceil["copy_bytes_per_s"]
    step_ms = 1e3 * statistics.median(step_s)
    return {
        "batch": batch,
        "prompt_len": workload.prompt_len,
        "timed_steps": workload.timed_steps,
        "step_ms": step_ms,
        "step_ms_min": 1e3 * min(step_s),
        "step_ms_max": 1e3 * max(step_s),
        "tok_per_s": batch / (step_ms * 1e-3),
        "floor_ms": 1e3 * floor_s,
        "x_floor": step_ms * 1e-3 / floor_s,
        "distinct_experts_per_layer": distinct / len(weights.layers),
        "bytes_dense_weights": dense,
        "bytes_routed_experts": experts,
        "bytes_cache": cache,
        "eager_tok_per_s": EAGER_DECODE_TOK_PER_S.get(batch) if eager else None,
        "eager_x_floor": EAGER_DECODE_X_FLOOR.get(batch) if eager else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_options(parser)
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,128; small: 1,4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 1024 (small: 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per batch (default 16; small: 3)")
    parser.add_argument("--out", default="bench/results/decode_step.json")
    args = parser.parse_args()
    workload = SMALL_WORKLOAD if args.small else FULL_WORKLOAD
    workload = dataclasses.replace(
        workload,
        batches=tuple(int(b) for b in args.batches.split(",")) if args.batches else workload.batches,
        prompt_len=args.prompt_len or workload.prompt_len,
        timed_steps=args.steps or workload.timed_steps,
    )
    device = prepare_device(args)
    ceil = ceilings(device)
    print(f"ceilings on {device}: {describe_ceilings(ceil)}", flush=True)
    biggest = max(workload.batches)
    engine = build_slice_engine(
        args,
        max_num_seqs=biggest,
        max_num_batched_tokens=max(workload.max_num_batched_tokens, biggest),
        tokens_per_request=workload.prompt_len + workload.max_tokens(biggest),
        graph_batch_sizes=workload.batches,
    )
    rows = []
    for batch in workload.batches:
        row = decode_case(engine, batch, workload, ceil, eager=not args.small)
        rows.append(row)
        print(
            f"batch {batch}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']:.1f} tok/s, "
            f"floor {row['floor_ms']:.2f} ms "
            f"({row['x_floor']:.1f}x), {row['distinct_experts_per_layer']:.1f} distinct experts/layer",
            flush=True,
        )
    result = {**environment(args, engine, ceil), "workload": dataclasses.asdict(workload), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print(
        "| batch | ms/step | tok/s | floor ms | x floor | experts/layer | GB dense / experts / cache "
        "| eager tok/s | eager x floor |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        eager = "-" if r["eager_tok_per_s"] is None else f"{r['eager_tok_per_s']:.1f}"
        eager_x = "-" if r["eager_x_floor"] is None else f"{r['eager_x_floor']:.0f}x"
        print(
            f"| {r['batch']} | {r['step_ms']:.2f} | {r['tok_per_s']:.1f} | {r['floor_ms']:.2f} | {r['x_floor']:.1f}x | "
            f"{r['distinct_experts_per_layer']:.1f} | {r['bytes_dense_weights'] / 1e9:.2f} / "
            f"{r['bytes_routed_experts'] / 1e9:.2f} / {r['bytes_cache'] / 1e9:.3f} | {eager} | {eager_x} |"
        )
    if not args.small:
        print("(eager: the issue's transformers-style implementation on the reference slice and an H200)")
    for r in rows:
        target = TARGET_X_FLOOR.get(r["batch"])
        if not args.small and target is not None:
            verdict = "met" if r["x_floor"] <= target else "missed"
            print(f"target: batch {r['batch']} within {target}x of the floor: {verdict} ({r['x_floor']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
