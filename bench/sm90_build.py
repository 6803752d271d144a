"""Registers, spills and shared memory of the attention launches built for sm_90 with no
GPU: each ATTENTION_SWEEP variant of bench/kernels.py (or the named ones), unsplit and
split over keys, on both pool formats at V4.1-Flash dims, compiled through
triton.compile for an sm_90 target and read from ptxas's -v log. What a tiling costs
before an H200 run times it (a spilling cut, one over the SM's 227 KB of shared memory).

The arguments are specialised as Triton's launcher would (16-byte aligned pointers and
multiples of 16 marked divisible), so the counts are a build's, not a guess; they are
the installed triton's, which may differ from the GPU machine's; that machine's
version builds here from its PyPI wheel, unpacked and put first on PYTHONPATH (its
bundled ptxas needs the executable bit). Usage (any machine with triton, no
TRITON_INTERPRET):
    python3 -m bench.sm90_build
    python3 -m bench.sm90_build --variants default mla
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re

# ptxas's -v log printed, and kernels in triton's cache rebuilt so that it is.
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from bench.kernels import ATTENTION_SWEEP, attention_case, fill_random  # noqa: E402
from dsv41.cache.plane_io import PlaneIO  # noqa: E402
from dsv41.cache.pools import PoolSize, V41Pools  # noqa: E402
from dsv41.cluster.pool_layout import pool_geometry  # noqa: E402
from dsv41.model.config import FLASH_CONFIG_DIR, V41Config  # noqa: E402
from dsv41.model.kernels.triton import KernelLaunch, TritonKernels  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
# A batch of 2 rows: programs_per_wave 1 never splits the keys, 1000 always does.
ROWS, CONTEXT = 2, 8192
LAUNCHES = {"unsplit": 1, "split": 1000}


def build(launch: KernelLaunch) -> dict:
    """The sm_90 build of ``launch``'s kernel with its arguments' specialisation:
    registers, spill bytes (stores, loads) and shared memory bytes."""
    constants = dict(launch.constants)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages")}
    signature, attrs, constexprs = {}, {}, {}
    args = iter(launch.args)
    for i, name in enumerate(launch.kernel.arg_names):
        if name in constants:
            signature[name], constexprs[name] = "constexpr", constants[name]
            continue
        arg = next(args)
        if isinstance(arg, torch.Tensor):
            signature[name] = mangle_type(arg)
            divisible = arg.data_ptr() % 16 == 0
        elif isinstance(arg, float):
            signature[name], divisible = "fp32", False
        else:
            signature[name] = "i64" if abs(arg) >= 2**31 else "i32"
            divisible = arg % 16 == 0 and arg != 0
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=SM90, options=options)
    text = log.getvalue()
    registers = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {
        "registers": int(registers[0]) if registers else None,
        "spill_bytes": tuple(int(b) for b in spills[0]) if spills else None,
        "shared_bytes": kernel.metadata.shared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(ATTENTION_SWEEP), help="default: all of them")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter builds nothing")
    config = V41Config.from_pretrained(FLASH_CONFIG_DIR, text_only=True)
    for kv, index in (("bf16", "fp8"), ("fp4", "fp4")):
        geometry = pool_geometry(config, block_size=128, kv_cache_dtype=kv, index_cache_dtype=index)
        pages_per_req = CONTEXT // 128
        pools = V41Pools(geometry, PoolSize(num_pages=ROWS * pages_per_req, num_slots=ROWS), device="cpu")
        fill_random(pools)
        att = attention_case(config, PlaneIO(pools), ROWS, CONTEXT, pages_per_req)
        for name in args.variants or ATTENTION_SWEEP:
            for launch_name, wave in LAUNCHES.items():
                tiling = dataclasses.replace(ATTENTION_SWEEP[name], programs_per_wave=wave)
                launch = TritonKernels(attention_tiling=tiling).prepare_attention(*att).launches[0]
                built = build(launch)
                print(
                    f"{kv}/{index} {name:42s} {launch_name:7s} registers {built['registers']} spill bytes "
                    f"(stores, loads) {built['spill_bytes']} shared {built['shared_bytes'] / 1024:.0f} KB",
                    flush=True,
                )


if __name__ == "__main__":
    main()
