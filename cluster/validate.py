"""Runtime validation: scheduled runs finish with the tokens of uninterrupted ones.

Owns the scenarios of the spec's "Scheduler acceptance" on any replica shape — the
one-rank in-process ``Engine``, a ``Engine`` whose ranks are threads of this
process, or whatever a caller's ``ReplicaFactory`` builds (``deploy`` builds the Ray
engine group's): chunked and reordered batches, prefix forks, replay from a missing
image, preemption, cancellation at every point, slot recycling, and, on the one-rank
engine, the parity of paged logits with the dense reference. There is no second
oracle of the scheduler: each request's expected tokens are its own uninterrupted run
on the replica under test (alone, one prefill chunk, nothing cached), computed once.
Only the same replica is a fair reference: a DP replica sums its experts in another
order than one rank does, and at full widths the FP8-rounded KV and the top-k
selections turn that last-bit difference into different tokens now and then
(BENCHMARKS.md, dp_group); the tests prove DP equal to one rank where the widths keep
it exact.
Every check of a replica reads only its public interface (outputs, ``request``,
``stats``).

Exact token equality holds under ``state_transfer="copy"`` (every resume is from an
exact state); ``replay`` changes logits after a hit by design, so its scenario
compares two runs that take the same hits.

Must not import: actors, deploy, ray.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from dsv41.cluster.distributed import BACKENDS
from dsv41.cluster.engine import Engine
from dsv41.cluster.interface import EngineClient, EngineStats
from dsv41.cluster.options import engine_options
from dsv41.cluster.ranks import EXPERT_MODES, DPLayout, ThreadedRanks
from dsv41.cluster.request import CumulativeOutputs, RequestOutput
from dsv41.cluster.sampling_params import SamplingParams
from dsv41.model.kernels import KERNEL_BACKENDS
from dsv41.model.loader import WEIGHT_STORAGE
from dsv41.model.params import ModelParams
from dsv41.model.reference import ReferenceModel
from dsv41.model.source import ModelSource
from tokenizers import Tokenizer

PARITY_CHUNKS = (3, 1, 129, 7, 128)
PARITY_TOLERANCE = 1e-4  # where parity is not exact (_parity says where it is)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REPLICA_KINDS = ("engine", "threads", "ray")
# PAGEs per rank of a scenario that sets no tighter pool: every scenario's requests
# and checkpoint images with room to spare, where the default byte budget would give
# a small model tens of thousands of PAGEs to allocate (seconds per replica and rank).
SCENARIO_POOL_PAGES = 512

Progress = Callable[[str], None]


class ValidationError(ValueError):
    """A replica shape or scenario selection the validation cannot run."""


@dataclass(frozen=True)
class ReplicaShape:
    """The replica under test: ``kind`` "engine" (the one-rank in-process Engine),
    "threads" (a Engine whose ranks are threads of this process, gloo among them)
    or "ray" (an engine group; its factory comes from the caller), over ``dp`` ranks
    with experts split ``expert_mode``, collectives on ``backend``, on ``device``, with
    the ``kernel_backend``'s kernels, in the batch-invariant mode unless
    ``batch_invariant`` is off (then a scheduled run's tokens are only as equal to its
    uninterrupted run's as the kernels are indifferent to batch shape). With
    ``speculative_method`` every scenario runs speculating, and its expected tokens are
    the uninterrupted runs without speculation: speculative greedy decoding must be
    plain greedy decoding, token for token. Likewise with ``cudagraph_mode`` "full"
    or "tr_hybrid" the expected tokens are eager runs': replayed graphs must give them. The
    replicas hold a quantised checkpoint's FP8 / FP4 weights as ``weight_storage`` says
    (the dense reference reads the same weights, each decoded exactly where it is used)."""

    kind: str = "engine"
    dp: int = 1
    expert_mode: str = "ep"
    backend: str = "gloo"
    device: str = "cpu"
    kernel_backend: str = "torch"
    batch_invariant: bool = True
    dtype: str = "float32"
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    cudagraph_mode: str = "none"
    weight_storage: str = "stored"

    def __post_init__(self) -> None:
        if self.kind not in REPLICA_KINDS:
            raise ValidationError(f"ReplicaShape.kind: {self.kind!r} (allowed: {', '.join(REPLICA_KINDS)})")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValidationError(f"ReplicaShape.dp: {self.dp!r} (allowed: an int >= 1)")
        if self.kind == "engine" and self.dp != 1:
            raise ValidationError(f"ReplicaShape.dp: {self.dp} for kind 'engine' (allowed: 1; 'threads' or 'ray' for DP)")
        if self.expert_mode not in EXPERT_MODES:
            raise ValidationError(f"ReplicaShape.expert_mode: {self.expert_mode!r} (allowed: {', '.join(EXPERT_MODES)})")
        if self.backend not in BACKENDS:
            raise ValidationError(f"ReplicaShape.backend: {self.backend!r} (allowed: {', '.join(BACKENDS)})")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValidationError(
                f"ReplicaShape.kernel_backend: {self.kernel_backend!r} (allowed: {', '.join(KERNEL_BACKENDS)})"
            )
        if self.dtype not in DTYPES:
            raise ValidationError(f"ReplicaShape.dtype: {self.dtype!r} (allowed: {', '.join(DTYPES)})")
        if self.weight_storage not in WEIGHT_STORAGE:
            raise ValidationError(
                f"ReplicaShape.weight_storage: {self.weight_storage!r} (allowed: {', '.join(WEIGHT_STORAGE)})"
            )
        if self.backend == "nccl" and not self.device.startswith("cuda"):
            raise ValidationError(f"ReplicaShape.backend: 'nccl' on device {self.device!r} (allowed: 'gloo' off CUDA)")
        # Threads share one device string, and gloo has no CUDA all_gather: in-process
        # ranks run on the host only.
        if self.kind == "threads" and (self.device != "cpu" or self.backend != "gloo"):
            raise ValidationError(
                f"ReplicaShape.device / backend: {self.device!r} / {self.backend!r} for kind 'threads' "
                "(allowed: 'cpu' / 'gloo'; kind 'ray' puts each rank on its own GPU)"
            )

    @property
    def layout(self) -> DPLayout:
        return DPLayout(self.dp, self.expert_mode, self.backend)


# Given a scenario's EngineOptions fields, a fresh replica (empty pools) for the
# scenario; leaving the context stops it.
ReplicaFactory = Callable[[dict[str, object]], AbstractContextManager[EngineClient]]


@dataclass(frozen=True)
class Workload:
    """Prompts for the scenarios: some share prefixes so forks and hits occur."""

    prompts: dict[str, list[int]]
    block_size: int

    @classmethod
    def build(cls, vocab_size: int, block_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab_size) for _ in range(n)]

        base = tokens(3 * block_size + 11)
        prompts = {
            "a": base,
            "fork-b": base[: 2 * block_size + 5] + tokens(9),
            "fork-c": base[: block_size + 3] + tokens(block_size),
            "short": tokens(7),
            "mid": tokens(block_size + 1),
            "long": tokens(4 * block_size - 3),
            # One PAGE each at admission, two once they decode: they outgrow a pool
            # that admitted them all.
            "edge-1": tokens(block_size - 3),
            "edge-2": tokens(block_size - 2),
            "edge-3": tokens(block_size - 1),
        }
        return cls(prompts=prompts, block_size=block_size)


@dataclass(frozen=True)
class _Run:
    """A scheduled run's finished outputs, the replica's stats at its end, and the
    prefix hits its schedulers took when admitting requests (summed over ranks; DP
    placement asks every rank's prefix index without counting a lookup)."""

    outputs: dict[str, RequestOutput]
    stats: EngineStats

    @property
    def admission_hits(self) -> int:
        return sum(r.hits for r in self.stats.ranks)

    @property
    def admission_hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.stats.ranks)


class _Finished(dict[str, RequestOutput]):
    """The whole outputs of the requests a run finished, by id, added up from each
    step's deltas."""

    def __init__(self) -> None:
        super().__init__()
        self._whole = CumulativeOutputs()

    def step(self, replica: EngineClient) -> None:
        """One step of ``replica``; keeps the outputs of the requests it finished."""
        for out in replica.step():
            whole = self._whole.add(out)
            if whole is not None:
                self[out.request_id] = whole


def _run(replica: EngineClient, arrivals: list[tuple[int, str, list[int]]]) -> _Run:
    """Adds each (step, name, prompt) when the step loop reaches its step; runs all
    to completion."""
    pending = sorted(arrivals, key=lambda a: a[0])
    finished = _Finished()
    step = 0
    while pending or replica.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, name, prompt = pending.pop(0)
            replica.add_request(name, prompt, GREEDY)
        finished.step(replica)
        step += 1
    return _Run(finished, replica.stats())


def _prompt_of(request_id: str) -> str:
    """A request id is its prompt's name, or ``name/copy`` for one of several copies."""
    return request_id.partition("/")[0]


def _compare(
    expected: dict[str, tuple[int, ...]], got: dict[str, RequestOutput], request_ids: Sequence[str]
) -> dict[str, bool]:
    return {rid: rid in got and got[rid].token_ids == expected[_prompt_of(rid)] for rid in request_ids}


def _pages_released(stats: EngineStats) -> bool:
    return all(r.requests == 0 and r.slots_used == 0 and r.pages_used == r.image_pages for r in stats.ranks)


class _Validation:
    """One validation run: the workload, the replica factory, the expected tokens,
    the report's scenario records, and, for the one-rank engine, its weights loaded
    once (its replicas and the parity scenarios)."""

    def __init__(
        self,
        vocab_size: int,
        params: ModelParams | None,
        tokenizer: Tokenizer | None,
        shape: ReplicaShape,
        factory: ReplicaFactory,
        block_size: int,
        progress: Progress,
    ) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.shape = shape
        self.factory = factory
        self.block_size = block_size
        self.progress = progress
        self.prompts = Workload.build(vocab_size, block_size).prompts
        self.expected: dict[str, tuple[int, ...]] = {}
        self.records: list[dict] = []

    def settings(self, **options: object) -> dict[str, object]:
        """A scenario's EngineOptions fields over the validation's defaults."""
        base: dict[str, object] = {
            "block_size": self.block_size,
            "state_transfer": "copy",
            "max_num_seqs": 8,
            "num_pages": SCENARIO_POOL_PAGES,
            "device": self.shape.device,
            "kernel_backend": self.shape.kernel_backend,
            "batch_invariant": self.shape.batch_invariant,
            "dtype": DTYPES[self.shape.dtype],
            "speculative_method": self.shape.speculative_method,
            "num_speculative_tokens": self.shape.num_speculative_tokens,
            "cudagraph_mode": self.shape.cudagraph_mode,
            "weight_storage": self.shape.weight_storage,
        }
        return base | options

    def engine(self, **options: object) -> Engine:
        """The one-rank in-process Engine over the loaded weights."""
        if self.params is None or self.tokenizer is None:
            raise ValidationError(f"the one-rank engine: replica kind {self.shape.kind!r} loads no weights here")
        return Engine.from_params(self.params, self.tokenizer, engine_options(self.settings(**options)))

    def replica(self, **options: object) -> AbstractContextManager[EngineClient]:
        return self.factory(self.settings(**options))

    def compute_expected(self) -> None:
        """Each prompt alone on one replica of the shape under test, one after the
        other: one prefill chunk each, nothing cached (prefix caching off)."""
        self.progress(f"uninterrupted runs of {len(self.prompts)} prompts")
        budget = max(64, *(len(prompt) for prompt in self.prompts.values()))
        plain = {"speculative_method": None, "num_speculative_tokens": None, "cudagraph_mode": "none"}
        with self.replica(enable_prefix_caching=False, max_num_batched_tokens=budget, **plain) as replica:
            for name, prompt in self.prompts.items():
                self.expected[name] = _run(replica, [(0, name, prompt)]).outputs[name].token_ids

    def record(self, name: str, checks: dict[str, bool], **facts: object) -> None:
        passed = all(checks.values())
        self.records.append({"name": name, "passed": passed, "checks": checks, **facts})
        self.progress(f"{name}: {'pass' if passed else 'FAIL'} {facts}")


def _chunked_reordered(v: _Validation) -> None:
    """A 32-token budget, arrival order shuffled and staggered."""
    order = list(v.prompts)
    random.Random(1).shuffle(order)
    with v.replica(max_num_batched_tokens=32, enable_prefix_caching=False) as replica:
        run = _run(replica, [(i * 3, name, v.prompts[name]) for i, name in enumerate(order)])
    v.record("chunked_reordered", _compare(v.expected, run.outputs, order), order=order)


def _prefix_forks(v: _Validation) -> None:
    """"a" first, then prompts sharing its prefix restore its images. Under DP the
    forks hit only if placement put them on the rank that cached "a"."""
    prompts = v.prompts
    with v.replica(max_num_batched_tokens=64) as replica:
        run = _run(replica, [(0, "a", prompts["a"]), (40, "fork-b", prompts["fork-b"]), (40, "fork-c", prompts["fork-c"])])
    checks = _compare(v.expected, run.outputs, ["a", "fork-b", "fork-c"])
    checks["took_prefix_hits"] = run.admission_hits >= 2
    v.record(
        "prefix_forks",
        checks,
        hits=run.admission_hits,
        hit_tokens=run.admission_hit_tokens,
        images=[r.images for r in run.stats.ranks],
    )


def _replay_from_missing_image(v: _Validation) -> None:
    """"a" prefilled in one chunk keeps an image only at its last full PAGE;
    "fork-c" hits one PAGE below any image and recomputes from 0."""
    prompts = v.prompts
    with v.replica(max_num_batched_tokens=512) as replica:
        run = _run(replica, [(0, "a", prompts["a"]), (30, "fork-c", prompts["fork-c"])])
    checks = _compare(v.expected, run.outputs, ["a", "fork-c"])
    checks["hit_without_image"] = run.admission_hit_tokens > 0
    v.record("replay_from_missing_image", checks, hit_tokens=run.admission_hit_tokens)


def _preemption(v: _Validation) -> None:
    """PAGEs per rank just above one request's need, a 32-token budget; one copy of
    the edge prompts per rank, all admitted at once: a rank given two or more of them
    outgrows its pool as they decode, and the check asks that every rank preempted."""
    edges = [name for name in v.prompts if name.startswith("edge-")]
    pages = -(-(len(v.prompts["edge-3"]) + GREEDY.max_tokens) // v.block_size) + 1
    request_ids = [f"{name}/{copy}" for copy in range(v.shape.dp) for name in edges]
    with v.replica(max_num_batched_tokens=32, num_pages=pages, enable_prefix_caching=False) as replica:
        run = _run(replica, [(0, rid, v.prompts[_prompt_of(rid)]) for rid in request_ids])
    checks = _compare(v.expected, run.outputs, request_ids)
    checks["preempted_on_every_rank"] = all(n > 0 for n in run.stats.preemptions)
    checks["pages_released"] = _pages_released(run.stats)
    v.record("preemption", checks, num_pages=pages, preemptions=list(run.stats.preemptions))


def _tight_mixed(v: _Validation) -> None:
    """Every prompt at once under a 32-token budget with PAGEs per rank just above
    the largest request's need, one request aborted mid-run."""
    prompts = v.prompts
    largest = max(len(p) for p in prompts.values()) + GREEDY.max_tokens
    pages = -(-largest // v.block_size) + 1
    got = _Finished()
    with v.replica(max_num_batched_tokens=32, num_pages=pages, enable_prefix_caching=False) as replica:
        for name, prompt in prompts.items():
            replica.add_request(name, prompt, GREEDY)
        while replica.has_unfinished_requests():
            got.step(replica)
            if "mid" not in got:
                mid = replica.request("mid")
                if mid is not None and mid.num_output_tokens:
                    replica.abort("mid")
        stats = replica.stats()
    checks = _compare(v.expected, got, [name for name in prompts if name != "mid"])
    checks["aborted_mid"] = "mid" not in got
    checks["pages_released"] = _pages_released(stats)
    v.record("tight_mixed", checks, num_pages=pages, preemptions=list(stats.preemptions))


def _cancellation(v: _Validation) -> None:
    """Aborts one request at each point of its life while the others run on."""
    prompts = v.prompts
    victims = {
        "waiting": prompts["long"],
        "mid-prefill": prompts["a"],
        "first-step": prompts["short"],
        "decoding": prompts["mid"],
    }
    survivors = ["fork-b", "fork-c"]
    aborted_at: dict[str, bool] = {}
    finished = _Finished()
    with v.replica(max_num_batched_tokens=32, max_num_seqs=3) as replica:
        for name in survivors:
            replica.add_request(name, prompts[name], GREEDY)
        for name, prompt in victims.items():
            replica.add_request(f"x-{name}", prompt, GREEDY)
        aborted_at["waiting"] = replica.abort("x-waiting")
        while replica.has_unfinished_requests():
            finished.step(replica)
            mid = replica.request("x-mid-prefill")
            if mid is not None and 0 < mid.num_computed_tokens < mid.num_prompt_tokens and "mid-prefill" not in aborted_at:
                aborted_at["mid-prefill"] = replica.abort("x-mid-prefill")
            first = replica.request("x-first-step")
            if first is not None and first.num_output_tokens == 1 and "first-step" not in aborted_at:
                aborted_at["first-step"] = replica.abort("x-first-step")
            decoding = replica.request("x-decoding")
            # At least: a speculating request gains several tokens a step.
            if decoding is not None and decoding.num_output_tokens >= 3 and "decoding" not in aborted_at:
                aborted_at["decoding"] = replica.abort("x-decoding")
        stats = replica.stats()
    checks = _compare(v.expected, finished, survivors)
    for point in victims:
        checks[f"aborted_{point}"] = aborted_at.get(point, False)
    checks["no_aborted_output"] = not any(name.startswith("x-") for name in finished)
    checks["pages_released"] = _pages_released(stats)
    v.record("cancellation", checks)


def _slot_recycle(v: _Validation) -> None:
    """Two STATE slots per rank serve every request in turn."""
    with v.replica(max_num_seqs=2, num_state_slots=2, max_num_batched_tokens=64) as replica:
        run = _run(replica, [(0, name, prompt) for name, prompt in v.prompts.items()])
    checks = _compare(v.expected, run.outputs, list(v.prompts))
    # Fewer slots in the replica than requests served: some slot served several.
    checks["slots_recycled"] = sum(r.num_slots for r in run.stats.ranks) < len(run.outputs)
    checks["pages_released"] = _pages_released(run.stats)
    v.record("slot_recycle", checks)


def _replay_same_hits(v: _Validation) -> None:
    """Replay (the default): hits replay a hash block below; two runs taking the same
    hits agree, and the hit really replayed."""
    prompts = v.prompts
    runs = []
    for _ in range(2):
        with v.replica(state_transfer="replay", max_num_batched_tokens=64) as replica:
            runs.append(_run(replica, [(0, "a", prompts["a"]), (40, "fork-b", prompts["fork-b"])]))
    first, second = (run.outputs for run in runs)
    checks = {
        name: name in first and name in second and first[name].token_ids == second[name].token_ids
        for name in ("a", "fork-b")
    }
    checks["a_equals_uninterrupted"] = "a" in first and first["a"].token_ids == v.expected["a"]
    checks["took_prefix_hit"] = all(run.admission_hits >= 1 for run in runs)
    v.record(
        "replay_same_hits", checks, fork_b_equals_cold="fork-b" in first and first["fork-b"].token_ids == v.expected["fork-b"]
    )


def _parity(v: _Validation, kv: str, index: str) -> None:
    """Every position's paged logits and top-k selections, prefilled in ragged chunks,
    against the dense reference."""
    prompt = v.prompts["long"]
    # The engine first: in the batch-invariant mode on a GPU it installs the Triton GEMM
    # the reference's arithmetic runs there too.
    engine = v.engine(kv_cache_dtype=kv, index_cache_dtype=index, enable_prefix_caching=False)
    reference = ReferenceModel(v.params, batch_invariant=v.shape.batch_invariant).forward(prompt)
    paged = engine.prompt_logits(prompt, chunk_sizes=PARITY_CHUNKS)
    # The engine hands its rows back on the host; the reference runs where the weights are.
    want = reference.logits.cpu()
    max_diff = float((paged.logits - want).abs().max())
    # Bit for bit where both sides run the same arithmetic: the torch backend in the
    # batch-invariant mode, on the CPU or a GPU. Triton's attention, scorer and expert
    # GEMMs are other sums (docs/ARCHITECTURE.md's departures say which, and why their
    # difference exceeds the tolerance at Flash widths).
    if v.shape.batch_invariant and v.shape.kernel_backend == "torch":
        checks = {"logits_equal": bool(torch.equal(paged.logits, want))}
    else:
        checks = {"logits_within_tolerance": torch.allclose(paged.logits, want, rtol=PARITY_TOLERANCE, atol=PARITY_TOLERANCE)}
    for layer, selected in reference.selections.items():
        checks[f"selections_layer_{layer}"] = bool(torch.equal(paged.selections[layer].cpu(), selected.cpu()))
    v.record(f"parity_{kv}_{index}", checks, max_abs_diff=max_diff, chunks=list(PARITY_CHUNKS))


SCHEDULER_SCENARIOS: dict[str, Callable[[_Validation], None]] = {
    "chunked_reordered": _chunked_reordered,
    "prefix_forks": _prefix_forks,
    "replay_from_missing_image": _replay_from_missing_image,
    "preemption": _preemption,
    "tight_mixed": _tight_mixed,
    "cancellation": _cancellation,
    "slot_recycle": _slot_recycle,
    "replay_same_hits": _replay_same_hits,
}
PARITY_SCENARIOS: dict[str, Callable[[_Validation], None]] = {
    "parity_bf16_fp8": lambda v: _parity(v, "bf16", "fp8"),
    "parity_fp4_fp4": lambda v: _parity(v, "fp4", "fp4"),
}
_EVERY_SCENARIO = {**SCHEDULER_SCENARIOS, **PARITY_SCENARIOS}
PARITY_NOT_SPECULATIVE = (
    "paged-vs-reference logits are a prefill's (Engine.prompt_logits), which speculation does not change; "
    "speculation refuses fp4 caches"
)
SCENARIOS = tuple(_EVERY_SCENARIO)
PARITY_NEEDS_ENGINE = (
    "paged-vs-reference logits come from Engine.prompt_logits, a one-rank forward outside the scheduler; "
    "a DP replica has no such call (its ranks run the one-rank attention the engine's parity covers)"
)


@contextmanager
def _threaded_replica(source: ModelSource, layout: DPLayout, settings: dict[str, object]) -> Iterator[Engine]:
    """A Engine whose ranks are threads of this process; leaving stops the threads."""
    options = engine_options(settings)
    ranks = ThreadedRanks(source, options, layout)
    try:
        yield Engine.over(source, layout, ranks, options)
    finally:
        ranks.close()


def _local_factory(
    shape: ReplicaShape, source: ModelSource, params: ModelParams | None, tokenizer: Tokenizer | None
) -> ReplicaFactory:
    """The factory of a replica this process builds itself: "engine" over the loaded
    weights, else "threads"."""
    if shape.kind == "engine":
        assert params is not None and tokenizer is not None
        return lambda settings: nullcontext(Engine.from_params(params, tokenizer, engine_options(settings)))
    return lambda settings: _threaded_replica(source, shape.layout, settings)


def run_validation(
    model: str | Path | ModelSource,
    *,
    shape: ReplicaShape = ReplicaShape(),
    factory: ReplicaFactory | None = None,
    scenarios: Sequence[str] | None = None,
    progress: Progress = lambda _: None,
    block_size: int = 32,
) -> dict:
    """Runs ``scenarios`` (default: every one ``shape`` supports) on replicas of
    ``model`` in ``shape.dtype`` and returns the JSON report. ``factory`` builds each scenario's
    replica; None builds the shape's own ("engine" or "threads")."""
    parity = shape.kind == "engine" and shape.speculative_method is None
    supported = list(SCENARIOS) if parity else list(SCHEDULER_SCENARIOS)
    wanted = list(supported if scenarios is None else scenarios)
    unknown = [name for name in wanted if name not in supported]
    if unknown or not wanted:
        raise ValidationError(f"scenarios: {unknown or 'none'} (allowed for replica kind {shape.kind!r}: {', '.join(supported)})")
    if factory is None and shape.kind == "ray":
        raise ValidationError("factory: None for replica kind 'ray' (allowed: the caller's engine-group factory)")
    source = ModelSource.parse(model)
    params = tokenizer = None
    if shape.kind == "engine":
        params, tokenizer = source.load_params(
            dtype=DTYPES[shape.dtype], device=shape.device, weight_storage=shape.weight_storage
        )
    if factory is None:
        factory = _local_factory(shape, source, params, tokenizer)
    v = _Validation(source.config().vocab_size, params, tokenizer, shape, factory, block_size, progress)
    v.compute_expected()
    for name, scenario in _EVERY_SCENARIO.items():
        if name in wanted:
            scenario(v)
    unsupported = PARITY_NEEDS_ENGINE if shape.speculative_method is None else PARITY_NOT_SPECULATIVE
    skipped = [
        {"name": name, "reason": "not requested" if name in supported else unsupported}
        for name in SCENARIOS
        if name not in wanted
    ]
    return {
        "model": str(source),
        "replica": asdict(shape),
        "block_size": block_size,
        "passed": all(record["passed"] for record in v.records),
        "scenarios": v.records,
        "skipped": skipped,
    }
