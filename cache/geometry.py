"""The byte geometry of the V4.1 cache: what a PAGE and a STATE entry hold.

Owns: ``V41PoolGeometry``, declared from plain topology data (layer count, Full owners
and their compress ratios, window, head and index dims, DSpark layers, Engram history
length) plus the runtime cache options (block size, ``kv_cache_dtype``,
``index_cache_dtype``, speculative tokens, encoder replay). From those it lays out

- a PAGE (``block_size`` tokens of global storage): per Full owner, its main KV rows
  (``block_size / ratio`` of them) and its index plane (values + E8M0 scales);
- a STATE entry (one per running request): the SWA rings, the cursor (committed
  position + the last compressed Engram ids), then the FP32 compressor tails of the
  ratio-2 owners. A checkpoint image is the entry's first ``image_bytes``: rings and
  cursor, never the tails (see ``image_bytes``).

Every plane starts on a 16-byte boundary and both unit sizes are multiples of 16, so
typed views of a page-major buffer are aligned for every dtype. ``layout_id`` names
everything a stored PAGE or image depends on.

Must not import: anything of this project but ``model.formats`` (the number formats'
block sizes), the scheduler, ray. Where the inputs come from (``AttentionTopology``) is
``cluster.pool_layout``'s business.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from dsv41.model.formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK

KV_CACHE_DTYPES = ("bf16", "fp4")
INDEX_CACHE_DTYPES = ("fp8", "fp4")
OWNER_RATIOS = (1, 2)
PLANE_ALIGNMENT = 16
# A block id of the index scorer names 16 index rows, and a ratio-2 owner halves the
# PAGE before that count is taken: 2 * 16 tokens is the smallest PAGE (spec,
# "Current execution scope").
MIN_BLOCK_SIZE = 32
# Cursor layout: int64 [position, engram ids oldest..newest]; an id before the
# sequence start (or not yet known after a replay reset) is DEAD.
CURSOR_POSITION = 0
DEAD_ENGRAM_ID = -1
# Bumped whenever the way planes are laid out changes, so old images are refused.
LAYOUT_VERSION = 1


class GeometryError(ValueError):
    """A pool geometry the runtime cannot lay out; the message names the field."""


class Region(enum.Enum):
    PAGE = "page"
    STATE = "state"


class PlaneKind(enum.Enum):
    """What a plane stores. PAGE planes are keyed by Full owner, rings by layer."""

    MAIN_KV = "main_kv"
    MAIN_KV_SCALES = "main_kv_scales"
    INDEX_VALUES = "index_values"
    INDEX_SCALES = "index_scales"
    SWA_RING = "swa_ring"
    SWA_SCALES = "swa_scales"
    CURSOR = "cursor"
    COMPRESSOR_TAIL = "compressor_tail"


# (kind, key, shape, dtype, encoding) of a plane before it is placed.
_PlaneDecl = tuple[PlaneKind, int | None, tuple[int, ...], torch.dtype, str]

_REGION_OF_KIND = {
    PlaneKind.MAIN_KV: Region.PAGE,
    PlaneKind.MAIN_KV_SCALES: Region.PAGE,
    PlaneKind.INDEX_VALUES: Region.PAGE,
    PlaneKind.INDEX_SCALES: Region.PAGE,
    PlaneKind.SWA_RING: Region.STATE,
    PlaneKind.SWA_SCALES: Region.STATE,
    PlaneKind.CURSOR: Region.STATE,
    PlaneKind.COMPRESSOR_TAIL: Region.STATE,
}


@dataclass(frozen=True)
class PlaneSpec:
    """One plane of a PAGE or STATE entry: ``shape`` elements of ``dtype`` at ``offset``
    bytes from the start of the unit. ``key`` is the Full owner (PAGE planes, tails),
    the layer (rings) or None (cursor); ``encoding`` says what the elements mean."""

    kind: PlaneKind
    key: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: str
    offset: int

    def __post_init__(self) -> None:
        if not self.shape or any(d <= 0 for d in self.shape):
            raise GeometryError(f"{self.kind.value}.shape: {self.shape} (allowed: positive dims)")
        if self.offset < 0 or self.offset % PLANE_ALIGNMENT:
            raise GeometryError(
                f"{self.kind.value}.offset: {self.offset} (allowed: a multiple of {PLANE_ALIGNMENT} bytes)"
            )

    @property
    def region(self) -> Region:
        return _REGION_OF_KIND[self.kind]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _align(nbytes: int) -> int:
    return -(-nbytes // PLANE_ALIGNMENT) * PLANE_ALIGNMENT


def _int_tuple(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise GeometryError(f"{name}: {value!r} (allowed: a sequence of ints)")
    return tuple(value)


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise GeometryError(f"{name}: {value!r} (allowed: a positive integer)")


@dataclass(frozen=True, kw_only=True)
class V41PoolGeometry:
    """The PAGE and STATE layout of one cache configuration.

    Topology inputs: ``num_layers`` target layers (each has an SWA ring),
    ``full_owners`` with ``owner_ratios`` (only owners allocate global storage),
    ``window`` (SWA rows, current token included), ``head_dim`` (main KV and ring
    rows), ``index_head_dim``, ``dspark_layers`` (the draft stages' layer ids) and
    ``engram_history`` (compressed Engram ids the cursor keeps:
    ``engram_max_ngram_size - 1``).

    Runtime options: ``block_size`` (tokens per PAGE, the prefix cache's hash block),
    ``kv_cache_dtype`` ("bf16": main rows are the model's NVFP4-rounded rows held
    exactly in bf16, SWA in bf16; "fp4": main rows packed NVFP4 + E4M3 scales per 16
    dims, packed from the row before rounding since re-packing a rounded row is lossy
    where the E4M3 scale is subnormal; SWA in FP8 + E8M0 scales per 32 dims), ``index_cache_dtype`` ("fp8": E4M3 +
    E8M0 per 32 dims, which holds MXFP4-rounded keys exactly; "fp4": packed E2M1 +
    E8M0 per 32 dims), ``num_speculative_tokens`` (slack rows in every ring and tail;
    also gives the DSpark stages their rings) and ``encoder_replay`` (a prefix hit
    without an image recomputes one PAGE below it, which must rebuild a window).
    """

    num_layers: int
    full_owners: tuple[int, ...]
    owner_ratios: tuple[int, ...]
    window: int
    head_dim: int
    index_head_dim: int
    dspark_layers: tuple[int, ...]
    engram_history: int
    block_size: int
    kv_cache_dtype: str
    index_cache_dtype: str
    num_speculative_tokens: int
    encoder_replay: bool

    page_planes: tuple[PlaneSpec, ...] = field(init=False, repr=False, compare=False)
    state_planes: tuple[PlaneSpec, ...] = field(init=False, repr=False, compare=False)
    page_bytes: int = field(init=False, repr=False, compare=False)
    image_bytes: int = field(init=False, repr=False, compare=False)
    state_bytes: int = field(init=False, repr=False, compare=False)
    layout_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_owners", _int_tuple("full_owners", self.full_owners))
        object.__setattr__(self, "owner_ratios", _int_tuple("owner_ratios", self.owner_ratios))
        object.__setattr__(self, "dspark_layers", _int_tuple("dspark_layers", self.dspark_layers))
        self._validate_options()
        self._validate_topology()
        self._validate_block_size()
        page_planes, page_bytes = _lay_out(self._page_plane_decls())
        ring_planes, image_bytes = _lay_out(self._image_plane_decls())
        tail_planes, state_bytes = _lay_out(self._tail_plane_decls(), start=image_bytes)
        object.__setattr__(self, "page_planes", page_planes)
        object.__setattr__(self, "state_planes", ring_planes + tail_planes)
        object.__setattr__(self, "page_bytes", page_bytes)
        object.__setattr__(self, "image_bytes", image_bytes)
        object.__setattr__(self, "state_bytes", state_bytes)
        object.__setattr__(self, "layout_id", self._layout_id())

    # -- validation -------------------------------------------------------------------

    def _validate_options(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise GeometryError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} (allowed: {', '.join(KV_CACHE_DTYPES)})"
            )
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise GeometryError(
                f"index_cache_dtype: {self.index_cache_dtype!r} (allowed: {', '.join(INDEX_CACHE_DTYPES)})"
            )
        if not isinstance(self.encoder_replay, bool):
            raise GeometryError(f"encoder_replay: {self.encoder_replay!r} (allowed: True, False)")
        spec = self.num_speculative_tokens
        if not isinstance(spec, int) or isinstance(spec, bool) or spec < 0:
            raise GeometryError(f"num_speculative_tokens: {spec!r} (allowed: an integer >= 0)")
        if spec and not self.dspark_layers:
            raise GeometryError(
                f"num_speculative_tokens: {spec}, but the model has no DSpark layers (allowed: 0)"
            )
        # The spec admits DSpark with BF16 caches only ("packed speculative caches are
        # rejected"; "keep BF16 KV and the FP8 index plane").
        if spec and (self.kv_cache_dtype, self.index_cache_dtype) != ("bf16", "fp8"):
            raise GeometryError(
                f"num_speculative_tokens: {spec} with kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"index_cache_dtype={self.index_cache_dtype!r}; packed speculative caches are "
                "refused (allowed: kv_cache_dtype='bf16' and index_cache_dtype='fp8')"
            )

    def _validate_topology(self) -> None:
        for name in ("num_layers", "window", "head_dim", "index_head_dim"):
            _require_positive(name, getattr(self, name))
        if not isinstance(self.engram_history, int) or self.engram_history < 0:
            raise GeometryError(f"engram_history: {self.engram_history!r} (allowed: an integer >= 0)")
        owners, ratios = self.full_owners, self.owner_ratios
        if not owners:
            raise GeometryError("full_owners: empty (allowed: at least one Full owner)")
        if list(owners) != sorted(set(owners)) or not 0 <= owners[0] <= owners[-1] < self.num_layers:
            raise GeometryError(
                f"full_owners: {list(owners)} (allowed: strictly increasing layer ids in [0, {self.num_layers}))"
            )
        if len(ratios) != len(owners):
            raise GeometryError(
                f"owner_ratios: {len(ratios)} entries for {len(owners)} full_owners (allowed: one per owner)"
            )
        for owner, ratio in zip(owners, ratios):
            if ratio not in OWNER_RATIOS:
                raise GeometryError(
                    f"owner_ratios: owner {owner} has ratio {ratio} (allowed: {', '.join(map(str, OWNER_RATIOS))})"
                )
        dspark = self.dspark_layers
        if list(dspark) != sorted(set(dspark)) or (dspark and dspark[0] < self.num_layers):
            raise GeometryError(
                f"dspark_layers: {list(dspark)} (allowed: strictly increasing ids >= num_layers {self.num_layers})"
            )
        # Ring rows are FP8-blocked by 32 under fp4, main rows NVFP4-blocked by 16, index
        # rows MXFP4-blocked by 32: every dim must split into whole scale blocks.
        for name, block in (("head_dim", math.lcm(FP8_BLOCK, NVFP4_BLOCK)), ("index_head_dim", MXFP4_BLOCK)):
            if getattr(self, name) % block:
                raise GeometryError(
                    f"{name}: {getattr(self, name)} (allowed: a multiple of {block}, the scale block)"
                )

    def _validate_block_size(self) -> None:
        b = self.block_size
        _require_positive("block_size", b)
        ratios = sorted(set(self.owner_ratios))
        not_dividing = [r for r in ratios if b % r]
        problems = []
        if b % 2:
            problems.append("odd")
        if b < MIN_BLOCK_SIZE:
            problems.append(f"under {MIN_BLOCK_SIZE} tokens (a block id names 16 index rows of a ratio-2 owner)")
        if not_dividing:
            problems.append(f"not a multiple of compress ratio(s) {not_dividing}")
        if problems:
            raise GeometryError(
                f"block_size: {b} is {' and '.join(problems)} (allowed: an even number of tokens >= "
                f"{MIN_BLOCK_SIZE}, a multiple of every owner ratio {ratios})"
            )
        if self.encoder_replay and b < self.window - 1:
            raise GeometryError(
                f"block_size: {b} is shorter than window - 1 = {self.window - 1}; encoder replay rebuilds "
                f"the window from one PAGE below a hit (allowed: block_size >= {self.window - 1}, "
                "or encoder_replay=False)"
            )

    # -- derived sizes ----------------------------------------------------------------

    @property
    def swa_dtype(self) -> str:
        """The SWA rings' format: bf16, or FP8 when the main pool is packed."""
        return "fp8" if self.kv_cache_dtype == "fp4" else "bf16"

    @property
    def ring_rows(self) -> int:
        """Rows per SWA ring: the window plus slack, so rejected speculative rows only
        overwrite rows no accepted query can still see."""
        return self.window + self.num_speculative_tokens

    @property
    def tail_rows(self) -> int:
        """Pending (v, g) rows per ratio-2 owner: the committed one plus one per
        speculative row a verify forward may leave pending. (?) MODEL_FACTS section 9
        gives tails speculative slack without a count; this is the reading."""
        return 1 + self.num_speculative_tokens

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """Layers with an SWA ring: every target layer, and the DSpark stages when
        speculation is on (nothing reads or writes their rings otherwise)."""
        draft = self.dspark_layers if self.num_speculative_tokens else ()
        return tuple(range(self.num_layers)) + draft

    @property
    def tail_owners(self) -> tuple[int, ...]:
        """Full owners with a compressor tail: ratio 2 pools token pairs, ratio 1 none."""
        return tuple(o for o, r in zip(self.full_owners, self.owner_ratios) if r == 2)

    @property
    def cursor_len(self) -> int:
        return 1 + self.engram_history

    @property
    def image_pages(self) -> int:
        """PAGEs one checkpoint image occupies."""
        return -(-self.image_bytes // self.page_bytes)

    def ratio_of(self, owner: int) -> int:
        if owner not in self.full_owners:
            raise GeometryError(f"owner: {owner} is not a Full owner (allowed: {list(self.full_owners)})")
        return self.owner_ratios[self.full_owners.index(owner)]

    def rows_per_page(self, owner: int) -> int:
        """Compressed (main and index) rows one PAGE holds for ``owner``."""
        return self.block_size // self.ratio_of(owner)

    def plane(self, kind: PlaneKind, key: int | None = None) -> PlaneSpec:
        """The plane of ``kind`` for owner/layer ``key``."""
        planes = self.page_planes if _REGION_OF_KIND[kind] is Region.PAGE else self.state_planes
        for p in planes:
            if p.kind is kind and p.key == key:
                return p
        keys = [p.key for p in planes if p.kind is kind]
        if not keys:
            raise GeometryError(
                f"{kind.value}: no such plane under kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"index_cache_dtype={self.index_cache_dtype!r}"
            )
        raise GeometryError(f"{kind.value}: no plane for {key!r} (allowed: {keys})")

    # -- layout -----------------------------------------------------------------------

    def _page_plane_decls(self) -> list[_PlaneDecl]:
        decls: list[_PlaneDecl] = []
        d, di = self.head_dim, self.index_head_dim
        for owner in self.full_owners:
            rows = self.rows_per_page(owner)
            if self.kv_cache_dtype == "bf16":
                decls.append((PlaneKind.MAIN_KV, owner, (rows, d), torch.bfloat16, "bf16 (NVFP4-rounded)"))
            else:
                decls.append((PlaneKind.MAIN_KV, owner, (rows, d // 2), torch.uint8, "NVFP4 e2m1 x2"))
                decls.append(
                    (PlaneKind.MAIN_KV_SCALES, owner, (rows, d // NVFP4_BLOCK), torch.uint8, "e4m3 / 16 dims")
                )
            if self.index_cache_dtype == "fp8":
                decls.append((PlaneKind.INDEX_VALUES, owner, (rows, di), torch.uint8, "e4m3 (MXFP4-rounded)"))
            else:
                decls.append((PlaneKind.INDEX_VALUES, owner, (rows, di // 2), torch.uint8, "e2m1 x2"))
            decls.append(
                (PlaneKind.INDEX_SCALES, owner, (rows, di // MXFP4_BLOCK), torch.uint8, "e8m0 / 32 dims")
            )
        return decls

    def _image_plane_decls(self) -> list[_PlaneDecl]:
        decls: list[_PlaneDecl] = []
        rows, d = self.ring_rows, self.head_dim
        for layer in self.ring_layers:
            if self.swa_dtype == "bf16":
                decls.append((PlaneKind.SWA_RING, layer, (rows, d), torch.bfloat16, "bf16 (FP8-rounded)"))
            else:
                decls.append((PlaneKind.SWA_RING, layer, (rows, d), torch.uint8, "e4m3"))
                decls.append((PlaneKind.SWA_SCALES, layer, (rows, d // FP8_BLOCK), torch.uint8, "e8m0 / 32 dims"))
        decls.append((PlaneKind.CURSOR, None, (self.cursor_len,), torch.int64, "position, engram ids (DEAD=-1)"))
        return decls

    def _tail_plane_decls(self) -> list[_PlaneDecl]:
        return [
            (PlaneKind.COMPRESSOR_TAIL, owner, (self.tail_rows, 2, self.head_dim), torch.float32, "fp32 v, g")
            for owner in self.tail_owners
        ]

    def _layout_id(self) -> str:
        """A short stable name of everything a PAGE or image depends on. Encoder replay
        is left out: it changes what the runtime does, not a stored byte."""
        description = {
            "version": LAYOUT_VERSION,
            "block_size": self.block_size,
            "window": self.window,
            "num_speculative_tokens": self.num_speculative_tokens,
            "head_dim": self.head_dim,
            "index_head_dim": self.index_head_dim,
            "num_layers": self.num_layers,
            "ring_layers": list(self.ring_layers),
            "full_owners": list(self.full_owners),
            "owner_ratios": list(self.owner_ratios),
            "engram_history": self.engram_history,
            "kv_cache_dtype": self.kv_cache_dtype,
            "index_cache_dtype": self.index_cache_dtype,
            "planes": [
                [p.kind.value, p.key, list(p.shape), str(p.dtype), p.offset]
                for p in self.page_planes + self.state_planes
            ],
        }
        canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
        return "v41-" + hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()

    # -- rendering --------------------------------------------------------------------

    def describe(self) -> str:
        """The plane table of a PAGE and a STATE entry, and the totals."""
        header = (
            f"{'plane':<16} {'owner/layer':>11} {'shape':>14} {'dtype':<9} {'encoding':<31} "
            f"{'offset':>9} {'bytes':>9}"
        )

        def rows(planes: tuple[PlaneSpec, ...]) -> list[str]:
            return [
                f"{p.kind.value:<16} {'-' if p.key is None else p.key:>11} {'x'.join(map(str, p.shape)):>14} "
                f"{str(p.dtype).removeprefix('torch.'):<9} {p.encoding:<31} {p.offset:>9} {p.nbytes:>9}"
                for p in planes
            ]

        lines = [
            f"V4.1 pool geometry {self.layout_id}",
            f"block_size={self.block_size} kv_cache_dtype={self.kv_cache_dtype} "
            f"index_cache_dtype={self.index_cache_dtype} swa={self.swa_dtype} window={self.window} "
            f"speculative_tokens={self.num_speculative_tokens} encoder_replay={self.encoder_replay}",
            f"full owners (ratio): {', '.join(f'{o} ({r})' for o, r in zip(self.full_owners, self.owner_ratios))}",
            "",
            f"PAGE ({self.block_size} tokens)",
            header,
            *rows(self.page_planes),
            "",
            f"STATE entry ({len(self.ring_layers)} rings of {self.ring_rows} rows, "
            f"{len(self.tail_owners)} compressor tails of {self.tail_rows} rows)",
            header,
            *rows(self.state_planes),
            "",
            f"PAGE bytes:             {self.page_bytes:>12,}",
            f"STATE image bytes:      {self.image_bytes:>12,}  (rings + cursor; {self.image_pages} PAGEs per image)",
            f"STATE entry bytes:      {self.state_bytes:>12,}",
        ]
        return "\n".join(lines)


def _lay_out(
    decls: list[_PlaneDecl], start: int = 0
) -> tuple[tuple[PlaneSpec, ...], int]:
    """Places planes one after another on 16-byte boundaries; returns them and the
    aligned end."""
    planes: list[PlaneSpec] = []
    offset = start
    for kind, key, shape, dtype, encoding in decls:
        plane = PlaneSpec(kind=kind, key=key, shape=shape, dtype=dtype, encoding=encoding, offset=offset)
        planes.append(plane)
        offset = _align(plane.end)
    return tuple(planes), offset
