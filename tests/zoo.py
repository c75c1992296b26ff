"""A generated test matrix over the model classes of Hugging Face transformers ("the zoo").

Why: hand-written configs (``tests/hf_cases.py``) cover the families someone thought of. The zoo
walks transformers' own auto mappings instead, shrinks every family's *default* config with one
generic set of rules (2 layers, width 64, 4 heads, vocab 256, dropout off, ...), builds it with
random weights and keeps it only if one eager forward runs on the generic inputs of its kind. A
family added to transformers is therefore covered without anyone writing a config for it, and a
family the rules cannot handle shows up in ``skipped()`` with the reason instead of silently
disappearing.

Kinds and their inputs (see ``ZooCase.inputs``):

* ``decoder`` / ``moe``: causal LMs (``moe`` when the default config has more than one expert and
  the built model has expert modules); ``input_ids`` only, no attention mask.
* ``encoder``: base models of encoder-only text families; ``input_ids`` plus a right-padded
  ``attention_mask``.
* ``encoder-decoder``: seq2seq LMs; ``input_ids`` plus ``decoder_input_ids``.
* ``vision``: image classifiers; ``pixel_values`` of shape (batch, 3, 32, 32).

Nothing is downloaded: every model is built from a config. Models come back as constructed (training
mode; no dropout or router jitter, so a forward is deterministic except for batch norm statistics).
The survey (build + one forward of every candidate, 10-30 s on an idle 2-core CPU) runs once per
process, on the first call of ``zoo_cases()`` or ``skipped()``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import re

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

KINDS = ("decoder", "encoder", "encoder-decoder", "vision", "moe")
VOCAB = 256
IMAGE_SIZE = 32
CHANNELS = 3
NUM_LABELS = 10
MAX_PARAMS = 20_000_000  # a shrunk model above this kept a size the rules do not know about

WIDTH, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 64, 128, 2, 4, 2, 16, 64
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_FFN, LORA_RANK, WINDOW = 4, 2, 32, 32, 8


def _sizes_table() -> dict[str, int]:
    widths = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
    ffns = ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim")
    layers = (
        "num_hidden_layers",
        "num_layers",
        "n_layer",
        "encoder_layers",
        "decoder_layers",
        "num_encoder_layers",
        "num_decoder_layers",
    )
    heads = ("num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads", "num_heads")
    return {
        **dict.fromkeys(widths, WIDTH),
        **dict.fromkeys(ffns, FFN),
        **dict.fromkeys(layers, LAYERS),
        **dict.fromkeys(heads, HEADS),
        "num_key_value_heads": KV_HEADS,
        **dict.fromkeys(("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM),
        **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), LORA_RANK),  # multi-head latent attention
        "vocab_size": VOCAB,
        **dict.fromkeys(("max_position_embeddings", "n_positions"), POSITIONS),
        **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), EXPERT_FFN),
    }


# Sizes set wherever the config has the field (under this name or through its attribute_map).
SIZES = _sizes_table()
# Other names of the feed-forward width, and of head counts and head widths (capped, never raised).
FFN_NAME = re.compile(r"intermediate|(^|_)(d_?ff|dim_ff|d_inner|ffn_dim|ffn_hidden_size|feed_forward_size)$")
HEADS_NAME = re.compile(r"_heads$")
KV_HEADS_NAME = re.compile(r"(key_value|kv)_heads$")
HEAD_DIM_NAME = re.compile(r"head_dim$")
# Main sizes a default config repeats under other names (e.g. ``embedding_size == hidden_size``).
SAME_AS = {"hidden_size": WIDTH, "intermediate_size": FFN, "head_dim": HEAD_DIM}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXTRA_EXPERT_COUNTS = ("zero_expert_num",)
EXPERTS_PER_TOKEN_NAMES = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k",
    "moe_k",
    "moe_topk",
    "top_k_experts",
)
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
WINDOWS = ("sliding_window", "attention_chunk_size", "attention_window")  # local attention narrower than the inputs
DEPTH_LISTS = ("depths", "depth", "block_sizes")  # blocks per stage
WIDTH_LISTS = ("hidden_sizes", "embed_dim", "embed_dims")  # width per stage

# Substrings of forward arguments for other modalities: a class taking one is multimodal, audio, ...
OTHER_MODALITIES = ("pixel", "image", "video", "audio", "speech", "input_features", "input_values", "past_values")


@dataclasses.dataclass(frozen=True)
class ZooCase:
    family: str  # the model_type, e.g. "llama"
    kind: str  # one of KINDS
    class_name: str  # e.g. "LlamaForCausalLM"
    variant: int = 0  # index into VARIANTS: the plain rules, or the fallback this family needed

    def build(self) -> torch.nn.Module:
        """A fresh tiny model with random weights and every dropout at 0."""
        config = copy.deepcopy(_tiny_config(self.family, self.kind, self.class_name, self.variant))
        return _model_class(self.class_name)(config)

    def inputs(self, batch: int = 2, seq: int = 16, seed: int = 0) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for one forward call."""
        return _INPUTS[self.kind](batch, seq, torch.Generator().manual_seed(seed))


def zoo_cases(kinds=None) -> list[ZooCase]:
    """Every family that builds and runs, sorted by kind then family; ``kinds`` filters (a str or an iterable)."""
    wanted = {kinds} if isinstance(kinds, str) else set(kinds or KINDS)
    return [case for case in _survey()[0] if case.kind in wanted]


def skipped() -> list[tuple[str, str]]:
    """``(family, reason)`` for every candidate the generator could not build or run; reasons start with the kind."""
    return list(_survey()[1])


# ---------------------------------------------------------------------------------------------- inputs


def _token_ids(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=gen, dtype=torch.int64)


def _decoder_inputs(batch, seq, gen):
    return (_token_ids(batch, seq, gen),), {}


def _encoder_inputs(batch, seq, gen):
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[::2, seq - 3 :] = 0  # right padding on every other row
    return (_token_ids(batch, seq, gen),), {"attention_mask": mask}


def _seq2seq_inputs(batch, seq, gen):
    ids = _token_ids(batch, seq, gen)
    return (ids,), {"decoder_input_ids": _token_ids(batch, seq, gen)}


def _vision_inputs(batch, seq, gen):
    return (torch.randn(batch, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=gen),), {}


_INPUTS = {
    "decoder": _decoder_inputs,
    "moe": _decoder_inputs,
    "encoder": _encoder_inputs,
    "encoder-decoder": _seq2seq_inputs,
    "vision": _vision_inputs,
}


def _main_input(kind: str) -> str:
    return "pixel_values" if kind == "vision" else "input_ids"


# ------------------------------------------------------------------------------------------ candidates


def _first(class_names) -> str:
    return class_names[0] if isinstance(class_names, (tuple, list)) else class_names


def _candidates() -> list[tuple[str, str, str]]:
    """``(family, kind, class_name)`` from the auto mappings; "decoder" may still turn into "moe"."""
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    seq2seq = modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    images = modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    base = modeling_auto.MODEL_MAPPING_NAMES
    encoders = [
        family
        for family in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if family not in causal and family not in seq2seq and family in base
    ]
    return [
        *((family, "decoder", _first(name)) for family, name in causal.items()),
        *((family, "encoder", _first(base[family])) for family in encoders),
        *((family, "encoder-decoder", _first(name)) for family, name in seq2seq.items()),
        *((family, "vision", _first(name)) for family, name in images.items()),
    ]


def _model_class(class_name: str) -> type:
    return getattr(transformers, class_name)


def _config_class(family: str, class_name: str) -> type:
    """The family's config class, or the model's own when that is a sub-config of it (e.g. a text config)."""
    family_config = CONFIG_MAPPING[family]
    wanted = _model_class(class_name).config_class
    return wanted if wanted in family_config.sub_configs.values() else family_config


def _not_generic(kind: str, class_name: str) -> str | None:
    """Why a class needs inputs the generic ones of its kind do not provide, or None."""
    params = inspect.signature(_model_class(class_name).forward).parameters
    main = _main_input(kind)
    others = [p for p in params if p != main and any(word in p for word in OTHER_MODALITIES)]
    if kind == "vision" and "input_ids" in params:
        others.append("input_ids")
    if others:
        return f"multimodal / audio / extra inputs: forward takes {', '.join(others)}"
    if main not in params:
        return f"forward has no {main} argument"
    return None


def _owner_first(candidate) -> bool:
    """Sort key: the family whose own config class the model takes comes before its aliases."""
    family, _, class_name = candidate
    try:
        return _config_class(family, class_name).model_type != family
    except Exception:  # noqa: BLE001 - a broken candidate is reported later, by _try
        return True


def _alias_of(family: str, class_name: str, claimed: dict) -> str | None:
    """The family that already covers the same class and config class (e.g. gpt-sw3 -> gpt2), or None."""
    owner = claimed.setdefault((class_name, _config_class(family, class_name)), family)
    return owner if owner != family else None


# ------------------------------------------------------------------------------------- reading configs


def _field(config, name: str) -> str | None:
    """The dataclass field behind ``name`` (itself or its attribute_map target), or None."""
    fields = {f.name for f in dataclasses.fields(config)}
    for candidate in (name, config.attribute_map.get(name)):
        if candidate in fields:
            return candidate
    return None


def _value(config, name: str):
    """The stored value of a field, read past the per-layer guard of heterogeneous configs (and attribute_map)."""
    stored = vars(config)
    key = config.attribute_map.get(name, name)
    return stored[key] if key in stored else stored.get(name)


def _get(config, name: str):
    """The value behind ``name`` if the config has such a field, else None."""
    field = _field(config, name)
    return _value(config, field) if field else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_int(v) for v in value)


def _int_fields(config):
    """``(field, value)`` for every int field."""
    for f in dataclasses.fields(config):
        if _is_int(value := _value(config, f.name)):
            yield f.name, value


def _layer_count(config) -> int | None:
    """The number of layers, also when it is a property of the config (e.g. the length of its layer pattern)."""
    count = _get(config, "num_hidden_layers")
    if count is None and not _field(config, "num_hidden_layers"):
        count = getattr(type(config), "num_hidden_layers", None)
        count = count.fget(config) if isinstance(count, property) else None
    return count if _is_int(count) else None


def _stage_count(config) -> int | None:
    """The number of stages of a hierarchical (vision) config, or None."""
    for name in DEPTH_LISTS:
        if _is_int_list(depths := _value(config, name)):
            return len(depths)
    return None


# ---------------------------------------------------------------------------------------- shrink rules
# Each rule maps a default config to constructor keyword arguments (lists still one entry per default
# layer); later rules win, and _restrict_layers then keeps LAYERS of the layers.


def _derived_sizes(default) -> dict:
    """Sizes that repeat a main size under another name follow it (``embedding_size == hidden_size``), widths
    named after the hidden size too (``hidden_size_global``), and lists splitting the hidden size
    (``axial_pos_embds_dim``) keep their proportions."""
    out = {name: WIDTH for name, value in _int_fields(default) if name.startswith("hidden_size_") and value}
    for name, new in SAME_AS.items():
        old = _get(default, name)
        if not _is_int(old) or not old:
            continue
        for other, value in _int_fields(default):
            if value == old and ("size" in other or "dim" in other):
                out[other] = new
        for f in dataclasses.fields(default):
            parts = _value(default, f.name)
            if name == "hidden_size" and _is_int_list(parts) and len(parts) > 1 and sum(parts) == old:
                out[f.name] = [v * new // old for v in parts]
    return out


def _capped_by_name(default) -> dict:
    """Feed-forward widths, head counts and head widths under any name, capped at FFN, HEADS / KV_HEADS, HEAD_DIM."""
    out = {}
    for name, value in _int_fields(default):
        if FFN_NAME.search(name):
            out[name] = min(value, FFN)
        elif KV_HEADS_NAME.search(name):
            out[name] = min(value, KV_HEADS)
        elif HEADS_NAME.search(name):
            out[name] = min(value, HEADS)
        elif HEAD_DIM_NAME.search(name):
            out[name] = min(value, HEAD_DIM)
    return out


def _named_sizes(default) -> dict:
    """The SIZES table; a per-layer list of one of them (e.g. ``intermediate_size``) gets the size everywhere."""
    out = {}
    for name, new in SIZES.items():
        field = _field(default, name)
        value = _value(default, field) if field else None
        if field and (value is None or _is_int(value)):
            out[field] = new
        elif field and _is_int_list(value) and len(value) == _layer_count(default):
            out[field] = [new] * len(value)
    return out


def _vocabularies(default) -> dict:
    """Any other vocabulary (entities, hashed n-grams, per-layer inputs) no larger than the main one."""
    return {name: VOCAB for name, value in _int_fields(default) if "vocab" in name and value > VOCAB}


def _no_dropout(default) -> dict:
    """Every dropout-like probability (and router jitter, the other training-time noise) at 0."""

    def is_dropout(name: str) -> bool:
        noise = any(word in name for word in ("dropout", "drop_path", "jitter"))
        return noise or name.endswith(("_pdrop", "_prob", "layerdrop"))

    out = {}
    for f in dataclasses.fields(default):
        value = _value(default, f.name)
        if is_dropout(f.name) and isinstance(value, float):
            out[f.name] = 0.0
        elif is_dropout(f.name) and isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            out[f.name] = [0.0] * len(value)  # per stage
    return out


def _special_tokens(default) -> dict:
    """Special token ids inside the small vocabulary: pad 0, bos 1, eos 2, any other too large one 3, 4, ..."""
    out = {_field(default, name): token for name, token in SPECIAL_TOKENS.items() if _field(default, name)}
    extra = iter(range(len(SPECIAL_TOKENS), VOCAB))
    for f in dataclasses.fields(default):
        value = _value(default, f.name)
        if f.name.endswith("_token_id") and f.name not in out:
            if isinstance(value, list) or (_is_int(value) and value >= VOCAB):
                out[f.name] = next(extra)
    return out


def _experts(default) -> dict:
    """At most 4 experts, 2 per token; grouped routing in one group; the first layer stays dense if it was."""
    out = {}
    routed = _has_experts(default)
    for names, cap in ((EXPERT_COUNTS + EXTRA_EXPERT_COUNTS, EXPERTS), (EXPERTS_PER_TOKEN_NAMES, EXPERTS_PER_TOKEN)):
        for name in names:
            field = _field(default, name)
            value = _value(default, field) if field else None
            if (_is_int(value) and value > cap) or (field and value is None and routed):
                out[field] = cap
    for name in ("n_group", "topk_group"):
        if _is_int(_get(default, name)):
            out[_field(default, name)] = 1
    if _is_int(dense := _value(default, "first_k_dense_replace")):
        out["first_k_dense_replace"] = min(dense, LAYERS - 1)
    for name, value in _int_fields(default):
        if name.endswith("sparse_step"):
            out[name] = min(value, LAYERS)
    return out


def _has_experts(config) -> bool:
    return any(_is_int(value := _get(config, name)) and value > 1 for name in EXPERT_COUNTS)


def _layer_counts(default) -> dict:
    """Counts of special layers (e.g. ``num_kv_shared_layers``) shrink with the layer count, rounded down."""
    count = _layer_count(default)
    if not _is_int(count) or not count:
        return {}
    return {
        name: value * LAYERS // count
        for name, value in _int_fields(default)
        if name.endswith("_layers") and name not in SIZES and 0 < value < count
    }


def _layer_periods(default) -> dict:
    """Every-k-th-layer patterns (``attn_layer_period`` / ``attn_layer_offset``) repeat within the kept layers."""
    out = {}
    for name, period in _int_fields(default):
        offset = name.removesuffix("_period") + "_offset"
        if name.endswith("_period") and period > LAYERS and _is_int(_value(default, offset)):
            out[name] = LAYERS
            out[offset] = _value(default, offset) % LAYERS
    return out


def _rotary(default) -> dict:
    """An absolute rotary width keeps its fraction of the head; RoPE scaling starts below the new positions."""
    out = {}
    heads, width = _get(default, "num_attention_heads"), _get(default, "hidden_size")
    rotary = _get(default, "rotary_dim")
    if _is_int(rotary) and _is_int(heads) and _is_int(width):
        out["rotary_dim"] = max(2, 2 * round(HEAD_DIM * rotary * heads / width / 2))
    if isinstance(rope := _value(default, "rope_parameters"), dict):
        out["rope_parameters"] = _small_rope(rope)
    return out


def _small_rope(rope: dict) -> dict:
    """A copy of (possibly per-layer-type) RoPE parameters with ``original_max_position_embeddings`` scaled down."""
    rope = copy.deepcopy(rope)
    for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
        if _is_int(params.get("original_max_position_embeddings")):
            params["original_max_position_embeddings"] = max(1, int(POSITIONS // (params.get("factor") or 1)))
    return rope


def _windows(default) -> dict:
    """Local attention windows (one, or one per layer) narrower than the inputs, so they matter."""
    out = {}
    for name in WINDOWS:
        value = _value(default, name)
        if _is_int(value) and value > WINDOW:
            out[name] = WINDOW
        elif _is_int_list(value):
            out[name] = [min(v, WINDOW) for v in value]
    return out


def _state_space_heads(default) -> dict:
    """State-space heads (mamba2 style) must cover ``expand * hidden_size``."""
    out = {}
    for prefix in ("", "mamba_"):
        expand = _get(default, prefix + "expand") or _get(default, "expand")
        heads = _field(default, prefix + "num_heads") or _field(default, prefix + "n_heads")
        head_dim = _field(default, prefix + "head_dim")
        if _is_int(expand) and heads and head_dim and _is_int(_value(default, heads)):
            out.update({heads: expand * WIDTH // HEAD_DIM, head_dim: HEAD_DIM})
    return out


def _depths(default) -> dict:
    """One block per stage (hierarchical vision models, funnel)."""
    return {name: [1] * len(value) for name in DEPTH_LISTS if _is_int_list(value := _value(default, name))}


def _text_rules(default, kind: str) -> dict:
    out = {}
    if _field(default, "use_cache"):
        out["use_cache"] = False
    if kind in ("decoder", "moe") and _field(default, "is_decoder"):
        out["is_decoder"] = True
    return out


def _vision_rules(default, kind: str) -> dict:
    """32x32 images, 10 labels, patches of 8 (4 for hierarchical models), hierarchical models narrow."""
    if kind != "vision":
        return {}
    out = {"num_labels": NUM_LABELS}
    for name, value in (("image_size", IMAGE_SIZE), ("num_channels", CHANNELS)):
        if _is_int(_get(default, name)):
            out[_field(default, name)] = value
    stages = _stage_count(default)
    if _is_int(patch := _value(default, "patch_size")):
        out["patch_size"] = min(patch, 4 if stages else 8)
    if stages:
        out.update(_stage_widths(default, stages))
    if _is_int(groups := _value(default, "num_groups")):
        out["num_groups"] = min(groups, 8)  # group norms over the narrower channels
    return out


def _stage_widths(default, stages: int) -> dict:
    """Stage widths scaled so the last is WIDTH (an int ``embed_dim`` is the first, doubled by every stage),
    per-stage head counts scaled alike; windowed attention (swin) gets 2x2 windows and patches small
    enough for the last stage to hold one window."""
    out, scale = {}, None
    if _get(default, "num_hidden_layers") == stages:  # the "layer" count is the stage count (convnext, segformer)
        out[_field(default, "num_hidden_layers")] = stages
    for name in WIDTH_LISTS:
        widths = _value(default, name)
        if _is_int_list(widths):
            scale = WIDTH / max(widths)
            out[name] = [max(8, 8 * round(w * scale / 8)) for w in widths]
        elif _is_int(widths) and widths:
            out[name] = max(8, WIDTH // 2 ** (stages - 1))
            scale = out[name] / widths
    for name in ("num_heads", "num_attention_heads"):
        heads = _get(default, name)
        if _is_int_list(heads) and scale:
            out[_field(default, name)] = [max(1, math.floor(h * scale)) for h in heads]
    if _is_int(_value(default, "window_size")):
        out["window_size"] = 2
        out["patch_size"] = max(1, IMAGE_SIZE // (2 * 2 ** (stages - 1)))
    return out


RULES = (
    _derived_sizes,
    _capped_by_name,
    _named_sizes,
    _vocabularies,
    _no_dropout,
    _special_tokens,
    _experts,
    _layer_counts,
    _layer_periods,
    _rotary,
    _windows,
    _state_space_heads,
    _depths,
)


# ------------------------------------------------------------------------------------- keeping layers


def _per_layer_lists(default) -> dict[str, list]:
    """Every stored list with one entry per layer (layer_types, mlp_layer_types, layers_block_type, ...)."""
    count = _layer_count(default)
    return {
        name: list(value)
        for name, value in vars(default).items()
        if not name.startswith("_") and isinstance(value, (list, tuple)) and count and len(value) == count
    }


def _per_layer_overrides(default) -> dict[int, dict]:
    """The per-layer field overrides of a heterogeneous config (e.g. other heads on some layers), or {}."""
    spec = vars(default).get("_heterogeneity_spec")
    return dict(spec.per_layer_overrides) if spec is not None else {}


def _kept_layers(default) -> list[int]:
    """The LAYERS layers of the default model the tiny one keeps, in order: layer 0, then each time the layer
    adding the most per-layer values not seen yet (e.g. a full attention layer after sliding ones)."""
    count = _layer_count(default) or LAYERS
    lists, overrides = _per_layer_lists(default), _per_layer_overrides(default)

    def signature(i: int) -> list[str]:
        return [repr(values[i]) for values in lists.values()] + [repr(sorted(overrides.get(i, {}).items()))]

    kept, seen = [0], [{value} for value in signature(0)]
    while len(kept) < min(LAYERS, count):
        rest = [i for i in range(count) if i not in kept]
        best = max(rest, key=lambda i: (sum(v not in s for v, s in zip(signature(i), seen, strict=True)), -i))
        kept.append(best)
        for value, values in zip(signature(best), seen, strict=True):
            values.add(value)
    kept.sort()
    return kept + [kept[-1]] * (LAYERS - len(kept))


def _keep_sums(default, out: dict) -> dict:
    """A head width that was the sum of two of its parts (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``:
    same prefix) still is."""
    dims = {name: value for name, value in _int_fields(default) if HEAD_DIM_NAME.search(name)}
    sums = {}
    for total, value in dims.items():
        prefix = total[: -len("head_dim")]
        parts = [name for name in dims if prefix and name != total and name.startswith(prefix) and name in out]
        for a, b in ((a, b) for a in parts for b in parts if a < b and dims[a] + dims[b] == value):
            sums[total] = out[a] + out[b]
    return sums


def _restrict_layers(default, out: dict) -> dict:
    """Per-layer lists, per-layer overrides and lists of layer indices restricted to the kept layers."""
    count = _layer_count(default)
    if not _is_int(count) or _stage_count(default) == count:  # stage lists are not per-layer lists
        return {}
    kept = _kept_layers(default)
    restricted = {}
    for name, values in _per_layer_lists(default).items():
        shrunk = out.get(name)
        values = shrunk if isinstance(shrunk, list) and len(shrunk) == count else values
        restricted[name] = [values[i] for i in kept]
    if overrides := _per_layer_overrides(default):
        restricted["per_layer_config"] = {
            new: _shrunk_layer(default, overrides[old]) for new, old in enumerate(kept) if old in overrides
        }
    for f in dataclasses.fields(default):
        value = _value(default, f.name)
        is_index_list = f.name.endswith(("_layers", "idxs", "indices", "_layer_ids")) and _is_int_list(value)
        if is_index_list and len(value) != count and max(value) < count:
            restricted[f.name] = [new for new, old in enumerate(kept) if old in value]
    return restricted


def _shrunk_layer(default, overrides: dict) -> dict:
    """One layer's overrides, each size scaled like its global value (so a layer twice as wide stays so)."""
    out = dict(overrides)
    for name, value in overrides.items():
        old = _get(default, name)
        if name in SIZES and _is_int(value) and _is_int(old) and old:
            out[name] = max(1, round(value * SIZES[name] / old))
    return out


# ----------------------------------------------------------------------------------- building configs


def _overrides(default, kind: str) -> dict:
    """Every generic change to a default config, as constructor keyword arguments."""
    out = {}
    for rule in RULES:
        out.update(rule(default))
    out.update(_text_rules(default, kind))
    out.update(_vision_rules(default, kind))
    out.update(_keep_sums(default, out))
    out.update(_restrict_layers(default, out))
    return out


def _without_gqa(kwargs: dict) -> dict:
    """As many key/value heads as query heads, for families without grouped-query attention (e.g. latent attention)."""
    out = copy.deepcopy(kwargs)
    for layer in [out, *out.get("per_layer_config", {}).values()]:
        if "num_key_value_heads" in layer:
            layer["num_key_value_heads"] = layer.get("num_attention_heads", out.get("num_attention_heads", HEADS))
    return out


# Tried in order until the family builds and runs: the rules as they are, then each fallback.
VARIANTS = (dict, _without_gqa)


def _shrink(config_class: type, kind: str, variant: int):
    """A tiny config of ``config_class``: its defaults with the generic overrides, sub-configs shrunk too."""
    default = config_class()
    kwargs = VARIANTS[variant](_overrides(default, kind))
    for key in config_class.sub_configs:
        if isinstance(getattr(default, key, None), transformers.PreTrainedConfig):
            kwargs[key] = _shrink(type(getattr(default, key)), kind, variant)
    return config_class(**kwargs)


@functools.lru_cache(maxsize=None)
def _tiny_config(family: str, kind: str, class_name: str, variant: int):
    return _shrink(_config_class(family, class_name), kind, variant)


# ---------------------------------------------------------------------------------------------- survey


@functools.lru_cache(maxsize=None)
def _survey() -> tuple[tuple[ZooCase, ...], tuple[tuple[str, str], ...]]:
    """Try every candidate once per process: the cases that run, and the reasons for the others."""
    cases, skips, claimed = [], [], {}
    for family, kind, class_name in sorted(_candidates(), key=_owner_first):
        outcome = _try(family, kind, class_name, claimed)
        if isinstance(outcome, ZooCase):
            cases.append(outcome)
        else:
            skips.append((family, f"{kind}: {outcome}"))
    cases.sort(key=lambda c: (c.kind, c.family))
    skips.sort()
    return tuple(cases), tuple(skips)


def _try(family: str, kind: str, class_name: str, claimed: dict) -> ZooCase | str:
    """The case, or why it cannot be built or run."""
    try:
        if reason := _not_generic(kind, class_name):
            return reason
        if owner := _alias_of(family, class_name, claimed):
            return f"same model class and config class as {owner}"
        if kind == "decoder" and _has_experts(_config_class(family, class_name)()):
            kind = "moe"
    except Exception as error:  # noqa: BLE001 - every failure becomes a skip reason
        return _describe(error)
    return _first_variant_that_runs(family, kind, class_name)


def _first_variant_that_runs(family: str, kind: str, class_name: str) -> ZooCase | str:
    """The case with the first variant that builds and runs, or each variant's error."""
    errors = []
    for variant in range(len(VARIANTS)):
        case = ZooCase(family, kind, class_name, variant)
        try:
            model = _check(case)
        except Exception as error:  # noqa: BLE001 - every failure becomes a skip reason
            errors.append(_describe(error))
            continue
        if kind == "moe" and not _has_expert_modules(model):  # e.g. experts configured but switched off
            case = dataclasses.replace(case, kind="decoder")
        return case
    reason = " | then ".join(dict.fromkeys(errors))  # each distinct error once
    return reason + _default_also_fails(family, class_name, errors[0])


def _check(case: ZooCase) -> torch.nn.Module:
    """The tiny model, after checking it is small and runs one eager forward on the inputs of its kind."""
    with torch.device("meta"):
        size = sum(p.numel() for p in case.build().parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"still {size / 1e6:.0f}M parameters after shrinking")
    model = case.build()
    args, kwargs = case.inputs()
    with torch.no_grad():
        model(*args, **kwargs)
    return model


def _has_expert_modules(model: torch.nn.Module) -> bool:
    return any("expert" in name for name, _ in model.named_modules())


def _describe(error: BaseException) -> str:
    """``Type: first line``, plus the first line of the cause when the message is only a wrapper's."""
    text = f"{type(error).__name__}: {_first_line(error)}"
    if error.__cause__ is not None:
        text += f" ({type(error.__cause__).__name__}: {_first_line(error.__cause__)})"
    return text


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _default_also_fails(family: str, class_name: str, error: str) -> str:
    """A hint when transformers' own default config fails to build with the same error (on the meta device)."""
    try:
        config = _config_class(family, class_name)()
        with torch.device("meta"):
            _model_class(class_name)(config)
    except Exception as default_error:  # noqa: BLE001
        if _describe(default_error) == error:
            return " [the default config fails the same way]"
    return ""
