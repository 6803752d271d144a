"""The model's weights arranged per layer, by role, for the arithmetic modules.

Owns the mapping from official tensor names (MODEL_FACTS section 8) to the weight
records each arithmetic module takes (attention, compressor, indexer, MoE, mHC,
Engram, the DSpark drafter), plus each layer's RoPE. Both the dense reference and the
paged runtime build their layers from here, so a name is spelled in one place.
Must not import: cache, cluster, actors, deploy, ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from dsv41.model.attention import AttentionWeights
from dsv41.model.compressor import CompressorWeights
from dsv41.model.config import LayerMode, LayerTopology, V41Config
from dsv41.model.device import move_tensors
from dsv41.model.engram import HOST_ENGRAM, EngramHashing, EngramKernels, EngramTable, engram_update
from dsv41.model.indexer import IndexerWeights
from dsv41.model.loader import ExpertShard, LoadedCheckpoint, LoadProgress, load_checkpoint
from dsv41.model.mhc import HcSite
from dsv41.model.moe import ExpertWeights, MoEWeights
from dsv41.model.rope import Rope
from dsv41.model.stored_weights import Weight


@dataclass(frozen=True)
class EngramParams:
    table: EngramTable
    wkv: Weight  # [(hc + 1) * hidden, input_dim]
    q_weight: torch.Tensor  # [hc, hidden]
    k_weight: torch.Tensor  # [hc, hidden]

    def apply(
        self, layer_id: int, streams: torch.Tensor, hashing: EngramHashing, ngrams: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Updates the streams before the attention site from each row's compressed
        n-grams [R, max_ngram] (ids at t, t-1, ..., pad-substituted)."""
        return self.update(streams, self.lookup(layer_id, hashing, ngrams), eps)

    def lookup(self, layer_id: int, hashing: EngramHashing, ngrams: torch.Tensor) -> torch.Tensor:
        """Each row's table rows [R, input_dim] (fp32, on the host) from its
        compressed n-grams. The tables live in host memory: rows are looked up on the
        CPU and only the gathered embeddings move to the streams' device."""
        return self.table.lookup(hashing.row_ids(layer_id, ngrams.cpu()))

    def update(
        self, streams: torch.Tensor, embeddings: torch.Tensor, eps: float, kernels: EngramKernels = HOST_ENGRAM
    ) -> torch.Tensor:
        """The gated update of the streams with each row's looked-up rows (the gated
        add by ``kernels``)."""
        embeddings = embeddings.to(device=streams.device, dtype=streams.dtype)
        return engram_update(streams, embeddings, self.wkv, self.q_weight, self.k_weight, eps, kernels)


@dataclass(frozen=True)
class LayerParams:
    topology: LayerTopology
    rope: Rope
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HcSite
    hc_ffn: HcSite
    attn: AttentionWeights
    compressor: CompressorWeights | None  # FULL layers
    indexer: IndexerWeights | None  # FULL and REINDEX layers
    moe: MoEWeights
    engram: EngramParams | None

    @property
    def layer_id(self) -> int:
        return self.topology.layer_id


@dataclass(frozen=True)
class DSparkParams:
    """The DSpark drafter's own weights (MODEL_FACTS section 9): three window stages
    (``mtp.0..2``, layer ids num_hidden_layers..+2, routed over dspark_n_routed_experts)
    and the heads of the first and last stage. Embedding and output head are the
    target's."""

    stages: tuple[LayerParams, ...]
    main_proj: torch.Tensor  # [hidden, len(dspark_target_layer_ids) * hidden]
    main_norm: torch.Tensor  # [hidden]
    norm: torch.Tensor  # [hidden]: the last stage's final norm
    markov_embed: torch.Tensor  # [vocab, dspark_markov_rank]
    markov_head: torch.Tensor  # [vocab, dspark_markov_rank]
    confidence_proj: torch.Tensor  # [1, hidden + dspark_markov_rank]


@dataclass(frozen=True)
class ModelParams:
    config: V41Config
    embed: torch.Tensor  # [vocab, hidden]
    head: torch.Tensor  # [vocab, hidden] fp32
    norm: torch.Tensor  # [hidden]
    layers: tuple[LayerParams, ...]  # the target layers
    engram_hashing: EngramHashing | None
    token_map: torch.Tensor  # [vocab] compressed Engram id of every token id
    dspark: DSparkParams | None = None  # None: the checkpoint ships no mtp.* tensors

    def to(self, device: torch.device | str) -> "ModelParams":
        """The same weights on ``device``, RoPE frequencies included (a captured decode
        graph reads them in place); Engram tables, their hashing and the token map stay
        on the host (tables a kernels backend reads on the device are mapped for it
        where they lie, and the runtime keeps its own copy of the hashing there)."""
        moved = move_tensors(self, device, keep=(EngramTable, EngramHashing, V41Config))
        return dataclasses.replace(moved, token_map=self.token_map)

    @classmethod
    def from_checkpoint(cls, checkpoint: LoadedCheckpoint) -> "ModelParams":
        if checkpoint.token_map is None or checkpoint.num_compressed is None:
            raise RuntimeError("ModelParams.from_checkpoint: the checkpoint's post_load has not run")
        return cls.build(
            checkpoint.config,
            checkpoint.tensors,
            checkpoint.engram_tables,
            checkpoint.token_map,
            checkpoint.num_compressed,
        )

    @classmethod
    def build(
        cls,
        config: V41Config,
        tensors: Mapping[str, torch.Tensor],
        engram_tables: Mapping[int, EngramTable],
        token_map: torch.Tensor,
        num_compressed: int,
    ) -> "ModelParams":
        layers = tuple(
            _layer_params(config, tensors, engram_tables, config.topology.layer(i), f"layers.{i}.")
            for i in range(config.num_hidden_layers)
        )
        hashing = (
            EngramHashing.from_config(config, token_map, num_compressed) if config.engram_layer_ids else None
        )
        # The loader holds the DSpark stages all or nothing (LoadedCheckpoint.has_dspark).
        has_dspark = config.num_nextn_predict_layers > 0 and any(name.startswith("mtp.") for name in tensors)
        return cls(
            config=config,
            embed=tensors["embed.weight"],
            head=tensors["head.weight"],
            norm=tensors["norm.weight"],
            layers=layers,
            engram_hashing=hashing,
            token_map=token_map,
            dspark=_dspark_params(config, tensors) if has_dspark else None,
        )


def _dspark_params(config: V41Config, tensors: Mapping[str, torch.Tensor]) -> DSparkParams:
    stages = tuple(
        _layer_params(config, tensors, {}, config.topology.layer(layer_id), f"mtp.{stage}.")
        for stage, layer_id in enumerate(config.topology.dspark_layers)
    )
    first, last = "mtp.0.", f"mtp.{len(stages) - 1}."
    return DSparkParams(
        stages=stages,
        main_proj=tensors[first + "main_proj.weight"],
        main_norm=tensors[first + "main_norm.weight"],
        norm=tensors[last + "norm.weight"],
        markov_embed=tensors[last + "markov_head.embed.weight"],
        markov_head=tensors[last + "markov_head.head.weight"],
        confidence_proj=tensors[last + "confidence_head.proj.weight"],
    )


def _layer_params(
    config: V41Config,
    tensors: Mapping[str, torch.Tensor],
    engram_tables: Mapping[int, EngramTable],
    topology: LayerTopology,
    prefix: str,
) -> LayerParams:
    """One block's weights under ``prefix`` (``layers.N.``, or ``mtp.S.`` for a DSpark stage)."""
    i = topology.layer_id

    def t(name: str) -> torch.Tensor:
        return tensors[prefix + name]

    def site(prefix: str) -> HcSite:
        return HcSite(fn=t(f"{prefix}_fn.weight"), base=t(f"{prefix}_base.weight"), scale=t(f"{prefix}_scale.weight"))

    attn = AttentionWeights(
        wq_a=t("attn.wq_a.weight"),
        q_norm=t("attn.q_norm.weight"),
        wq_b=t("attn.wq_b.weight"),
        wkv=t("attn.wkv.weight"),
        kv_norm=t("attn.kv_norm.weight"),
        wo_a=t("attn.wo_a.weight"),
        wo_b=t("attn.wo_b.weight"),
        attn_sink=t("attn.attn_sink"),
    )
    compressor = None
    if topology.mode is LayerMode.FULL:
        compressor = CompressorWeights(
            wkv=t("attn.compressor.wkv.weight"),
            wgate=t("attn.compressor.wgate.weight") if topology.ratio == 2 else None,
            norm=t("attn.compressor.norm.weight"),
            index_wk=t("attn.indexer.wk.weight"),
            index_k_norm=t("attn.indexer.k_norm.weight"),
        )
    indexer = None
    if topology.mode in (LayerMode.FULL, LayerMode.REINDEX):
        indexer = IndexerWeights(wq_b=t("attn.indexer.wq_b.weight"), weights_proj=t("attn.indexer.weights_proj.weight"))
    # A rank holds only its shard's experts; the ids present are the ones it loaded.
    expert_ids = sorted(
        {
            int(name[len(prefix) :].split(".")[2])
            for name in tensors
            if name.startswith(prefix + "ffn.experts.") and name.endswith(".w1.weight")
        }
    )
    moe = MoEWeights(
        gate=t("ffn.gate.weight"),
        bias=t("ffn.gate.bias"),
        experts={
            e: ExpertWeights(
                w1=t(f"ffn.experts.{e}.w1.weight"), w2=t(f"ffn.experts.{e}.w2.weight"), w3=t(f"ffn.experts.{e}.w3.weight")
            )
            for e in expert_ids
        },
        shared=(
            ExpertWeights(
                w1=t("ffn.shared_experts.w1.weight"),
                w2=t("ffn.shared_experts.w2.weight"),
                w3=t("ffn.shared_experts.w3.weight"),
            )
            if config.n_shared_experts
            else None
        ),
    )
    engram = None
    if topology.is_engram:
        engram = EngramParams(
            table=engram_tables[i],
            wkv=t("engram.wkv.weight"),
            q_weight=t("engram.q_weight"),
            k_weight=t("engram.k_weight"),
        )
    theta, yarn = config.layer_rope(i)
    return LayerParams(
        topology=topology,
        rope=Rope.build(config.qk_rope_head_dim, theta, yarn),
        attn_norm=t("attn_norm.weight"),
        ffn_norm=t("ffn_norm.weight"),
        hc_attn=site("hc_attn"),
        hc_ffn=site("hc_ffn"),
        attn=attn,
        compressor=compressor,
        indexer=indexer,
        moe=moe,
        engram=engram,
    )


def load_model_params(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    weight_storage: str = "decoded",
    shard: ExpertShard | None = None,
    text_only: bool = False,
    progress: Callable[[LoadProgress], None] | None = None,
) -> tuple[ModelParams, LoadedCheckpoint]:
    """Loads a checkpoint (one rank's shard of it) and arranges it per layer."""
    checkpoint = load_checkpoint(
        model_dir, dtype=dtype, weight_storage=weight_storage, shard=shard, text_only=text_only, progress=progress
    )
    return ModelParams.from_checkpoint(checkpoint), checkpoint
