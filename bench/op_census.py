"""Which source line issues each device op of a decode step: the op census.

The profile (bench/profile_step.py) names the kernels a decode step runs, but a
name like ``vectorized_elementwise_kernel<CUDAFunctor_add>`` does not say which line
of the model asked for it. This bench runs the real engine path on the reference
slice (or ``--small`` on a CPU, Triton kernels interpreted there), lets a few decode
steps warm up, then records every torch op one eager decode step dispatches, except
views (they launch nothing), each under the innermost frame (``--depth``: frames) of
this repository's packages that called it (allocations, which launch nothing, are
left out too), plus every Triton kernel launch under its kernel's name.
Ops a Triton launch issues inside Triton (the interpreter's copies on a CPU) are not
counted: on a GPU they do not exist. The table lists the sites by ops per step: what a
fusion at that site would remove. ``.item()``-style host syncs are ops too (aten
``_local_scalar_dense``); the census lists them apart.

It also splits the step's ops by what the TR_HYBRID graph mode would do with them:
those issued inside a layer's token-wise parts (model/runtime.PagedRuntime's
``open_layer``, ``close_layer`` and ``pad_layer``, which cluster/token_graphs.py
records) become graph replays, one per part called; the rest (attention, sampling,
the step's inputs) stay eager launches. Its projection of a TR_HYBRID step's launches
is the ops outside the parts, plus one replay per part, plus the copies into the
parts' buffers (the first layer's streams and pre, each Engram layer's table rows and
each layer's attention output).

``--prefill-len N`` censuses one whole N-token prefill step instead (after an
uncounted one): its sites, and the copies (copy_, _to_copy, clone, cat:
a device-to-device copy kernel each on a GPU) by the bytes they write, per site:
where a prefill profile's unnamed copy kernels come from.

Prints a table and writes JSON. On a CPU, in a few minutes:
    TRITON_INTERPRET=1 python3 -m bench.op_census --small --kernel-backend triton --no-batch-invariant
On the GPU machine, from the repo root:
    python3 -m bench.op_census [--batch 32 | --prefill-len 4096]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import functools
import os
import sys
from pathlib import Path
from types import FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.decode_step import FULL_WORKLOAD, SMALL_WORKLOAD
from bench.prefill import prefill_once
from bench.slice_engine import add_slice_options, build_slice_engine, prepare_device, random_prompts, start_decoding
from dsv41.cluster.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(REPO / p) + "/" for p in ("model", "cache", "cluster", "actors"))
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item"})
# Ops that only allocate: no kernel runs.
ALLOCATION_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that copy a tensor into a new or given one (a device-to-device copy kernel on a GPU).
COPY_OPS = frozenset({"copy_", "_to_copy", "clone", "cat"})


def _is_view(func: torch._ops.OpOverload) -> bool:
    """An op whose every return aliases an input without writing it: it moves no bytes."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@functools.cache
def _repo_path(filename: str) -> str:
    """The file's real path: the package may be imported through a symlinked root."""
    return os.path.realpath(filename)


def _site(frame: FrameType | None, depth: int) -> str | None:
    """``path:function`` of the ``depth`` innermost frames in this repository's packages
    (innermost first, joined by " <- "), or None when a Triton frame comes first (the op
    is the interpreter's, not the model's)."""
    chain: list[str] = []
    while frame is not None and len(chain) < depth:
        name = _repo_path(frame.f_code.co_filename)
        if name.startswith(PACKAGES):
            chain.append(f"{Path(name).relative_to(REPO)}:{frame.f_code.co_name}")
        elif not chain and f"{Path('triton')}/" in name and "site-packages" in name:
            return None
        frame = frame.f_back
    return " <- ".join(chain) or None


# The runtime's token-wise parts of a layer, which TR_HYBRID records as graphs.
TOKEN_PARTS = frozenset({"open_layer", "close_layer", "pad_layer"})
RUNTIME_FILE = str(REPO / "model" / "runtime.py")


def _in_token_part(frame: FrameType | None) -> bool:
    """Whether one of the runtime's token-wise parts is on the stack."""
    while frame is not None:
        if frame.f_code.co_name in TOKEN_PARTS and _repo_path(frame.f_code.co_filename) == RUNTIME_FILE:
            return True
        frame = frame.f_back
    return False


class OpCensus(TorchDispatchMode):
    """Counts the ops dispatched while active, by (site, op), and how many of them a
    token-wise part issued (``in_parts``)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        # Bytes the copy ops wrote, by (site, op): where a step's device copies go.
        self.copy_bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.in_parts = 0

    def count(self, site: str, op: str, frame: FrameType | None) -> None:
        self.ops[(site, op)] += 1
        if _in_token_part(frame):
            self.in_parts += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if not _is_view(func) and op not in ALLOCATION_OPS:
            frame = sys._getframe(1)
            site = _site(frame, self.depth)
            if site is not None:
                self.count(site, op, frame)
                if op in COPY_OPS and isinstance(out, torch.Tensor):
                    self.copy_bytes[(site, op)] += out.numel() * out.element_size()
        return out


def _count_triton_launches(census: OpCensus) -> list[object]:
    """Wraps Triton's launch entry points so each launch is counted under its kernel's
    name; returns what to restore."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    restore: list[object] = []
    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        original = cls.run

        def run(self, *args, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "kernel")
            census.count(f"triton:{name}", "launch", sys._getframe(1))
            with torch.utils._python_dispatch._disable_current_modes():
                return __original(self, *args, **kwargs)

        restore.append((cls, original))
        cls.run = run
    return restore


@dataclasses.dataclass
class PartCalls:
    """How often a step called each token-wise part, and with Engram table rows."""

    open_layer: int = 0
    close_layer: int = 0
    pad_layer: int = 0
    engram_rows: int = 0

    @property
    def replays(self) -> int:
        return self.open_layer + self.close_layer + self.pad_layer


def _count_part_calls(runtime, calls: PartCalls) -> None:  # type: ignore[no-untyped-def]
    """Wraps the runtime's parts (on the instance) so each call is counted."""
    for name in ("open_layer", "close_layer", "pad_layer"):
        original = getattr(runtime, name)

        def counted(*args, __original=original, __name=name, **kwargs):  # type: ignore[no-untyped-def]
            setattr(calls, __name, getattr(calls, __name) + 1)
            if __name == "open_layer" and args[3] is not None:
                calls.engram_rows += 1
            return __original(*args, **kwargs)

        setattr(runtime, name, counted)


def _census_one_step(engine, depth: int) -> tuple[OpCensus, PartCalls, list]:  # type: ignore[no-untyped-def]
    """The ops of the engine's next step, and its outputs."""
    census = OpCensus(depth)
    calls = PartCalls()
    runtime = engine.runner.runtime
    _count_part_calls(runtime, calls)
    restore = _count_triton_launches(census)
    try:
        with census:
            outputs = engine.step()
    finally:
        for cls, original in restore:  # type: ignore[misc]
            cls.run = original
        for name in ("open_layer", "close_layer", "pad_layer"):
            delattr(runtime, name)
    return census, calls, outputs


def census_step(engine, batch: int, prompt_len: int, warmup: int, depth: int) -> tuple[OpCensus, PartCalls]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=warmup + 4, temperature=0.0, ignore_eos=True)
    ids = [f"c{batch}-{i}" for i in range(batch)]
    start_decoding(engine, dict(zip(ids, random_prompts(batch, prompt_len, engine.config.vocab_size, seed=batch))),
                   params, warmup)
    census, calls, outputs = _census_one_step(engine, depth)
    if len(outputs) != batch:
        raise RuntimeError(f"batch {batch}: the censused step produced {len(outputs)} tokens (expected {batch})")
    for rid in ids:
        engine.abort(rid)
    return census, calls


def census_prefill(engine, prompt_len: int, depth: int) -> OpCensus:  # type: ignore[no-untyped-def]
    """The ops of one whole ``prompt_len``-token prefill in one engine step, after an
    uncounted one of another prompt (on a GPU: the kernels compiled)."""
    warm, counted = random_prompts(2, prompt_len, engine.config.vocab_size, seed=prompt_len)
    prefill_once(engine, "census-warm", warm)
    engine.add_request("census", counted, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    census, _, outputs = _census_one_step(engine, depth)
    if not any(o.request_id == "census" and o.finished for o in outputs):
        raise RuntimeError(f"prefill {prompt_len}: not done in one step (the batch budget must hold the prompt)")
    return census


def _summary(census: OpCensus, engine, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """What both censuses report: the run's arguments and device, the step's ops, its
    Triton launches and host syncs, and each site's ops by kind, most first."""
    ops = census.ops
    by_site: collections.Counter[str] = collections.Counter()
    for (site, _op), n in ops.items():
        by_site[site] += n
    return {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "device": str(engine.params.embed.device),
        "ops_per_step": sum(by_site.values()),
        "triton_launches_per_step": sum(n for (s, _), n in ops.items() if s.startswith("triton:")),
        "host_syncs": {f"{site} {op}": n for (site, op), n in ops.items() if op in HOST_SYNC_OPS},
        "sites": [
            {
                "site": site,
                "ops": n,
                "by_op": dict(collections.Counter({op: c for (s, op), c in ops.items() if s == site}).most_common()),
            }
            for site, n in by_site.most_common()
        ],
    }


def _write(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))


def prefill_main(args: argparse.Namespace) -> None:
    """--prefill-len: one prefill step's ops by site, and its copies by bytes written."""
    engine = build_slice_engine(
        args, max_num_seqs=2, max_num_batched_tokens=args.prefill_len, tokens_per_request=args.prefill_len + 16
    )
    census = census_prefill(engine, args.prefill_len, args.depth)
    copies = [
        {"site": site, "op": op, "copies": census.ops[(site, op)], "bytes": n}
        for (site, op), n in census.copy_bytes.most_common()
    ]
    result = {**_summary(census, engine, args), "prefill_len": args.prefill_len, "copies": copies}
    _write(result, args.out)
    print(f"\n{result['ops_per_step']} ops in one {args.prefill_len}-token prefill step "
          f"({result['triton_launches_per_step']} Triton launches); host syncs: {result['host_syncs'] or 'none'}")
    print("| copies | MB written | op | site |")
    print("|---:|---:|---|---|")
    for row in copies[: args.top]:
        print(f"| {row['copies']} | {row['bytes'] / 1e6:.1f} | {row['op']} | {row['site']} |")
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_slice_options(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=None, help="default 1024 (small: 128)")
    parser.add_argument("--top", type=int, default=40, help="sites listed")
    parser.add_argument("--depth", type=int, default=1, help="repository frames that name a site (1: the innermost)")
    parser.add_argument(
        "--prefill-len", type=int, default=None,
        help="census one whole prefill of this many tokens instead of a decode step: its sites, and the bytes "
        "each site's copies write",
    )
    parser.add_argument("--out", default="bench/results/op_census.json")
    args = parser.parse_args()
    if args.cudagraph_mode != "none":
        parser.error("--cudagraph-mode: the census counts an eager step's ops (allowed: none)")
    prepare_device(args)
    if args.prefill_len is not None:
        prefill_main(args)
        return
    workload = SMALL_WORKLOAD if args.small else FULL_WORKLOAD
    prompt_len = args.prompt_len or workload.prompt_len
    engine = build_slice_engine(
        args, max_num_seqs=args.batch, max_num_batched_tokens=max(workload.max_num_batched_tokens, args.batch),
        tokens_per_request=prompt_len + 16,
    )
    census, calls = census_step(engine, args.batch, prompt_len, warmup=2, depth=args.depth)
    summary = _summary(census, engine, args)
    total, rows, syncs = summary["ops_per_step"], summary["sites"], summary["host_syncs"]
    result = {
        **summary,
        "batch": args.batch,
        "prompt_len": prompt_len,
        "tr_hybrid": {
            "ops_in_token_parts": census.in_parts,
            "ops_outside": total - census.in_parts,
            "part_calls": dataclasses.asdict(calls),
            # The first layer's streams and pre, each Engram layer's table rows and each
            # layer's attention output are copied into the parts' buffers.
            "buffer_copies": 2 + calls.engram_rows + calls.close_layer,
            "projected_launches": total - census.in_parts + calls.replays + 2 + calls.engram_rows + calls.close_layer,
        },
    }
    _write(result, args.out)
    print(f"\n{total} ops in one decode step at batch {args.batch} "
          f"({result['triton_launches_per_step']} Triton launches); host syncs: {syncs or 'none'}")
    hybrid = result["tr_hybrid"]
    print(
        f"TR_HYBRID: {hybrid['ops_in_token_parts']} of them inside the token-wise parts ({calls.replays} part calls: "
        f"graph replays), {hybrid['ops_outside']} outside (eager); projected launches per step: "
        f"{hybrid['projected_launches']} (with {hybrid['buffer_copies']} copies into the parts' buffers)"
    )
    print("| ops | site | most frequent ops |")
    print("|---:|---|---|")
    for row in rows[: args.top]:
        common = ", ".join(f"{op} {c}" for op, c in list(row["by_op"].items())[:4])
        print(f"| {row['ops']} | {row['site']} | {common} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
