"""Where the model's topology meets the cache's geometry.

Owns: ``pool_geometry``, which derives the plain inputs of ``V41PoolGeometry`` (target
layers, Full owners and their ratios, window, dims, DSpark layers, Engram history
length) from a ``V41Config`` and its ``AttentionTopology``, and adds the runtime cache
options. ``dsv41 geometry`` prints its ``describe()``.

Must not import: actors, deploy, ray. ``cache/`` never learns about ``model.config``:
this module is the one place the two meet.
"""

from __future__ import annotations

from dsv41.cache.geometry import GeometryError, V41PoolGeometry
from dsv41.model.config import V41Config


def pool_geometry(
    config: V41Config,
    *,
    block_size: int = 128,
    kv_cache_dtype: str = "bf16",
    index_cache_dtype: str = "fp8",
    num_speculative_tokens: int = 0,
    encoder_replay: bool = True,
) -> V41PoolGeometry:
    """The PAGE/STATE geometry of ``config`` under the given cache options.
    Speculation is DSpark's: ``num_speculative_tokens`` is 0 or its block size."""
    topology = config.topology
    allowed_spec = (0, config.dspark_block_size) if topology.dspark_layers else (0,)
    if num_speculative_tokens not in allowed_spec:
        raise GeometryError(
            f"num_speculative_tokens: {num_speculative_tokens!r} (allowed: "
            f"{', '.join(map(str, allowed_spec))}; DSpark drafts dspark_block_size tokens)"
        )
    return V41PoolGeometry(
        num_layers=topology.num_target_layers,
        full_owners=topology.full_owners,
        owner_ratios=topology.owner_ratios,
        window=config.sliding_window,
        head_dim=config.head_dim,
        index_head_dim=config.index_head_dim,
        dspark_layers=topology.dspark_layers,
        engram_history=config.engram_max_ngram_size - 1,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
        num_speculative_tokens=num_speculative_tokens,
        encoder_replay=encoder_replay,
    )
