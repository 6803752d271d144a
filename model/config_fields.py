"""How a config.json's keys beyond DeepSeek-V4.1's own fields are treated.

Owns the generic fields transformers' ``PretrainedConfig`` writes into every config it
saves (``PRETRAINED_CONFIG_FIELDS``: accepted anywhere, those that would describe a
structure V4.1 lacks only at their absent values), the released config's
informational fields the runtime does not need, the top level's sections, the
once-per-file warning about a field nobody knows, and ``ConfigError``, the refusal of
any config field. ``model/config.py`` reads config.json with them.

Must not import: any other module of the project, torch.
"""

from __future__ import annotations

import json
import logging
from types import MappingProxyType
from typing import Any, Mapping

# The warnings are config.json reading's, whichever module words them.
logger = logging.getLogger("dsv41.model.config")


class ConfigError(ValueError):
    """A config.json value the runtime cannot serve; the message names the field."""


IGNORED_FIELDS = frozenset(
    {
        # Informational fields of the released config the runtime does not need.
        "initializer_range",
        "attention_bias",
        "attention_dropout",
        "hidden_act",
        "first_k_dense_replace",
        "n_group",
        "topk_group",
        "intermediate_size",
    }
)


# transformers' PretrainedConfig fields: the keys of ``PretrainedConfig().to_dict()``
# in transformers 4.48.3, 4.57.6 and 5.24.0 (what ``save_pretrained`` writes into a
# config.json and into each of its sub-configs), plus the generation parameters older
# versions kept in configs (transformers 5.24.0's
# ``GenerationConfig._get_default_generation_params()``: the keys 5.x pops from a config
# on load). Read from those versions' configuration_utils.py and checked by running
# their ``to_dict()``. ``architectures``, ``model_type``, ``bos/eos/pad_token_id`` and
# ``tie_word_embeddings`` are PretrainedConfig fields too, but carry meaning here:
# they are validated as V4.1's own fields instead.
#
# Each field maps to the values accepted. None: any value, for the fields that do not
# change what a token computes (bookkeeping; transformers' output switches;
# classification-head labels for a head this model does not have; TF and TorchScript
# switches; token ids of encoder-decoder and separator roles a decoder-only model does
# not use; generation defaults, since sampling comes from each request, as in
# transformers 5). A tuple: the values that mean the structure is absent (an
# encoder-decoder, cross-attention, pruned heads), the only ones V4.1 can have.
PRETRAINED_CONFIG_FIELDS: Mapping[str, tuple[Any, ...] | None] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "_name_or_path",
                "_attn_implementation_autoset",
                "transformers_version",
                "dtype",
                "torch_dtype",
                "return_dict",
                "output_attentions",
                "output_hidden_states",
                "torchscript",
                "use_bfloat16",
                "tf_legacy_loss",
                "chunk_size_feed_forward",
                "is_decoder",
                "id2label",
                "label2id",
                "problem_type",
                "finetuning_task",
                "task_specific_params",
                "tokenizer_class",
                "prefix",
                "sep_token_id",
                "decoder_start_token_id",
            ),
            None,
        ),
        **dict.fromkeys(
            (
                "max_length",
                "min_length",
                "do_sample",
                "use_cache",
                "early_stopping",
                "num_beams",
                "num_beam_groups",
                "diversity_penalty",
                "temperature",
                "top_k",
                "top_p",
                "typical_p",
                "epsilon_cutoff",
                "eta_cutoff",
                "repetition_penalty",
                "encoder_repetition_penalty",
                "length_penalty",
                "no_repeat_ngram_size",
                "encoder_no_repeat_ngram_size",
                "bad_words_ids",
                "num_return_sequences",
                "output_scores",
                "return_dict_in_generate",
                "forced_bos_token_id",
                "forced_eos_token_id",
                "remove_invalid_values",
                "exponential_decay_length_penalty",
                "suppress_tokens",
                "begin_suppress_tokens",
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
                "assistant_lookbehind",
                "target_lookbehind",
            ),
            None,
        ),
        "is_encoder_decoder": (False,),
        "tie_encoder_decoder": (False,),
        "add_cross_attention": (False,),
        "cross_attention_hidden_size": (None,),
        "pruned_heads": ({}, None),
    }
)
# The top level of the nested layout: its sections and what is checked there.
TOP_LEVEL_SECTIONS = frozenset({"architectures", "model_type", "text_config", "vision_config", "quantization_config"})
# The nested layout's top-level tie_word_embeddings is the composite wrapper's: 4.x
# writes PretrainedConfig's default (true) there unless the config class sets it, and
# ties a model with a text_config by the text config's value
# (get_text_config(decoder=True), as vLLM does). The text config's must be false; the
# head is the checkpoint's own head.weight, which the loader requires either way.
TOP_LEVEL_WRAPPER_FIELDS = frozenset({"tie_word_embeddings"})
# quantization_config keys besides QuantizationConfig's fields: which modules a
# quantiser left alone changes nothing here (the loader reads each tensor's stored
# form, plain or quantised, from its header).
QUANTIZATION_IGNORED = frozenset({"modules_to_not_convert"})
# (config.json path, field) pairs already warned about in this process.
_WARNED_UNKNOWN: set[tuple[str, str]] = set()


def same_value(value: Any, allowed: Any) -> bool:
    """Equal, a bool only to a bool (JSON's false is not 0)."""
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def check_pretrained_config_fields(values: Mapping[str, Any], section: str) -> None:
    """Refuses a PretrainedConfig field whose value describes a structure V4.1 lacks."""
    for name, allowed in PRETRAINED_CONFIG_FIELDS.items():
        if allowed is None or name not in values:
            continue
        if not any(same_value(values[name], a) for a in allowed):
            shown = ", ".join(json.dumps(a) for a in allowed)
            raise ConfigError(f"{section}{name}: {json.dumps(values[name])} is not supported (allowed: {shown})")


def warn_unknown(unknown: list[str], source: str | None) -> None:
    """One warning naming every field of ``source`` not warned about before."""
    new = [name for name in unknown if source is None or (source, name) not in _WARNED_UNKNOWN]
    if not new:
        return
    if source is not None:
        _WARNED_UNKNOWN.update((source, name) for name in new)
    logger.warning(
        "%s: ignoring field(s) this runtime does not know: %s (neither DeepSeek-V4.1 fields of "
        "MODEL_FACTS.md section 1 nor transformers' PretrainedConfig fields)",
        source or "config.json",
        ", ".join(new),
    )
