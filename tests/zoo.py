"""A generated test matrix over the model classes of Hugging Face transformers ("the zoo").

Why: hand-written configs (``tests/hf_cases.py``) cover the families someone thought of. The zoo
walks transformers' own auto mappings instead, shrinks every family's *default* config with one
generic set of rules (2 layers, width 64, 4 heads, vocab 256, dropout off, ...), builds it with
random weights and keeps it only if one eager forward runs on the generic inputs of its kind. A
family added to transformers is therefore covered without anyone writing a config for it, and a
family the rules cannot handle shows up in ``skipped()`` with the reason instead of silently
disappearing.

Kinds and their inputs (see ``ZooCase.inputs``):

* ``decoder`` / ``moe``: causal LMs (``moe`` when the default config has more than one expert);
  ``input_ids`` only, no attention mask.
* ``encoder``: base models of encoder-only text families; ``input_ids`` plus a right-padded
  ``attention_mask``.
* ``encoder-decoder``: seq2seq LMs; ``input_ids`` plus ``decoder_input_ids``.
* ``vision``: image classifiers; ``pixel_values`` of shape (batch, 3, 32, 32).

Nothing is downloaded: every model is built from a config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

KINDS = ("decoder", "encoder", "encoder-decoder", "vision", "moe")
VOCAB = 256
IMAGE_SIZE = 32
CHANNELS = 3
MAX_PARAMS = 20_000_000  # a shrunk model above this kept a size the rules do not know about

WIDTH, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 64, 128, 2, 4, 2, 16, 64
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_FFN = 4, 2, 32

# Scalar sizes, set wherever the config has the attribute (aliases get the same value).
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim"), WIDTH),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim"), FFN
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers", "num_decoder_layers"),
        LAYERS,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "encoder_attention_heads", "decoder_attention_heads", "num_heads"), HEADS
    ),
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": POSITIONS,
    "n_positions": POSITIONS,
    "moe_intermediate_size": EXPERT_FFN,
    "shared_expert_intermediate_size": EXPERT_FFN,
}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_NAMES = ("num_experts_per_tok", "top_k", "moe_k")
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}

VISION = {"image_size": IMAGE_SIZE, "num_channels": CHANNELS, "num_labels": 10}
STAGE_DEPTH, STAGE_WIDTHS = 1, (32, 64)

# Forward arguments of other modalities: a class taking one is multimodal (or audio, video, time series).
OTHER_MODALITIES = (
    "pixel_values", "pixel_values_videos", "input_features", "input_values", "audio_values", "past_values",
    "image_embeds", "audio_features",
)


@dataclasses.dataclass(frozen=True)
class ZooCase:
    family: str  # the model_type, e.g. "llama"
    kind: str  # one of KINDS
    class_name: str  # e.g. "LlamaForCausalLM"

    def build(self) -> torch.nn.Module:
        """A fresh tiny model with random weights and every dropout at 0."""
        return _model_class(self.class_name)(copy.deepcopy(_tiny_config(self.family, self.kind, self.class_name)))

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
_FEEDS = {"decoder": "input_ids", "moe": "input_ids", "encoder": "input_ids", "encoder-decoder": "input_ids"}


# ------------------------------------------------------------------------------------------ candidates


def _first(class_names) -> str:
    return class_names[0] if isinstance(class_names, (tuple, list)) else class_names


def _candidates() -> list[tuple[str, str, str]]:
    """``(family, kind, class_name)`` from the auto mappings; "decoder" may still turn into "moe"."""
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    seq2seq = modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    encoders = [
        family
        for family in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if family not in causal and family not in seq2seq and family in modeling_auto.MODEL_MAPPING_NAMES
    ]
    return [
        *((family, "decoder", _first(name)) for family, name in causal.items()),
        *((family, "encoder", _first(modeling_auto.MODEL_MAPPING_NAMES[family])) for family in encoders),
        *((family, "encoder-decoder", _first(name)) for family, name in seq2seq.items()),
        *(
            (family, "vision", _first(name))
            for family, name in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.items()
        ),
    ]


def _model_class(class_name: str) -> type:
    return getattr(transformers, class_name)


def _config_class(family: str, class_name: str) -> type:
    """The config class the model class takes: the family's, or its text sub-config (a trivial composite)."""
    family_config = CONFIG_MAPPING[family]
    wanted = _model_class(class_name).config_class
    if wanted is family_config or wanted in family_config.sub_configs.values():
        return wanted
    raise TypeError(f"{class_name} takes {wanted.__name__}, not {family_config.__name__} or one of its sub-configs")


def _not_generic(family: str, kind: str, class_name: str) -> str | None:
    """Why a candidate needs inputs the generic ones do not provide, or None."""
    params = inspect.signature(_model_class(class_name).forward).parameters
    feeds = _FEEDS.get(kind, "pixel_values")
    others = [p for p in params if p in OTHER_MODALITIES and p != feeds]
    if others:
        return f"multimodal / audio / time series: forward takes {', '.join(others)}"
    if feeds not in params and not (kind == "vision" and "inputs" in params):
        return f"forward has no {feeds} argument"
    return None


def _alias_of(family: str, class_name: str, claimed: dict) -> str | None:
    """The family that already covers the same class and config class (e.g. gpt-sw3 -> gpt2)."""
    key = (class_name, _config_class(family, class_name))
    owner = claimed.setdefault(key, family)
    return owner if owner != family else None


def _ordered(candidates):
    """A family whose own config class is the model's config class claims the pair first."""

    def owns(candidate):
        family, _, class_name = candidate
        try:
            return _config_class(family, class_name).model_type != family
        except Exception:
            return True

    return sorted(candidates, key=owns)


# --------------------------------------------------------------------------------------------- configs


def _has(config, name: str) -> bool:
    """Whether ``name`` is a field of the config (directly or through its attribute_map)."""
    return name in config.attribute_map or name in _fields(config)


def _fields(config) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def _field_name(config, name: str) -> str:
    return config.attribute_map.get(name, name)


def _is_int(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _scalar_sizes(default) -> dict:
    return {
        _field_name(default, name): value
        for name, value in SIZES.items()
        if _has(default, name) and _is_int(getattr(default, name))
    }


def _no_dropout(default) -> dict:
    def is_dropout(name: str) -> bool:
        return "dropout" in name or "drop_path" in name or name.endswith(("_pdrop", "_prob", "layerdrop"))

    return {
        name: 0.0 for name in _fields(default) if is_dropout(name) and isinstance(getattr(default, name), float)
    }


def _special_tokens(default) -> dict:
    """Special token ids inside the small vocabulary: pad 0, bos 1, eos 2, any other one 3, 4, ..."""
    out = {}
    extra = iter(range(3, VOCAB))
    for name in sorted(_fields(default)):
        value = getattr(default, name)
        if not name.endswith("_token_id") or value is None:
            continue
        if name in SPECIAL_TOKENS:
            out[name] = SPECIAL_TOKENS[name]
        elif isinstance(value, list) or value >= VOCAB:
            out[name] = next(extra)
    return out


def _experts(default) -> dict:
    out = {}
    for name in EXPERT_COUNTS:
        if _has(default, name) and isinstance(getattr(default, name), int) and getattr(default, name) > EXPERTS:
            out[_field_name(default, name)] = EXPERTS
    for name in EXPERTS_PER_TOKEN_NAMES:
        value = getattr(default, name, None) if _has(default, name) else None
        if isinstance(value, int) and value > EXPERTS_PER_TOKEN:
            out[_field_name(default, name)] = EXPERTS_PER_TOKEN
    for name in ("n_group", "topk_group"):  # grouped routing: one group of all experts
        if _has(default, name) and isinstance(getattr(default, name), int):
            out[name] = 1
    return out


def _layer_lists(default, layers: int) -> dict:
    """Per-layer lists cut to ``layers`` entries, keeping one of each distinct type first (e.g. sliding + full)."""
    count = getattr(default, "num_hidden_layers", None)
    out = {}
    for name in _fields(default):
        value = getattr(default, name)
        if not isinstance(value, (list, tuple)) or not value or len(value) != count or name in STAGE_LISTS:
            continue
        distinct = list(dict.fromkeys(value)) if all(isinstance(v, str) for v in value) else []
        out[_field_name(default, name)] = type(value)((distinct + list(value))[:layers])
    return out


STAGE_LISTS = ("depths", "hidden_sizes", "embed_dims", "num_heads", "num_attention_heads", "stage_names")


def _stages(default) -> dict:
    """Hierarchical vision models: 2 stages of depth 1, widths 32 and 64; other per-stage lists cut to 2."""
    depths = getattr(default, "depths", None)
    widths = getattr(default, "hidden_sizes", None)
    reference = depths if isinstance(depths, (list, tuple)) else widths
    if not isinstance(reference, (list, tuple)):
        return {}
    count = len(reference)
    n = len(STAGE_WIDTHS)
    out = {}
    for name in _fields(default):
        value = getattr(default, name)
        if isinstance(value, (list, tuple)) and len(value) == count and name not in ("out_features", "out_indices"):
            out[name] = list(value[:n])
    if isinstance(depths, (list, tuple)):
        out["depths"] = [STAGE_DEPTH] * n
    if isinstance(widths, (list, tuple)):
        out["hidden_sizes"] = list(STAGE_WIDTHS)
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(default, name, None), (list, tuple)):
            out[_field_name(default, name)] = [2 * 2**i for i in range(n)]
    for name in ("out_features", "out_indices", "stage_names"):
        if _has(default, name) and getattr(default, name) is not None:
            out[name] = None
    return out


def _vision(default) -> dict:
    out = {name: value for name, value in VISION.items() if _has(default, name) or name == "num_labels"}
    if _has(default, "patch_size"):
        out["patch_size"] = 4 if isinstance(getattr(default, "depths", None), (list, tuple)) else 8
    return out


def _overrides(default, kind: str) -> dict:
    """Every generic change to a default config, as constructor keyword arguments."""
    out = {
        **_scalar_sizes(default),
        **_no_dropout(default),
        **_special_tokens(default),
        **_experts(default),
        **_layer_lists(default, LAYERS),
    }
    if _has(default, "use_cache"):
        out["use_cache"] = False
    if kind == "vision":
        out.update(_vision(default))
        out.update(_stages(default))
    return out


def _shrink(config_class: type, kind: str):
    """A tiny config of ``config_class``: its defaults with the generic overrides, sub-configs shrunk too."""
    default = config_class()
    kwargs = _overrides(default, kind)
    for key in config_class.sub_configs:
        sub = getattr(default, key, None)
        if isinstance(sub, transformers.PreTrainedConfig):
            kwargs[key] = _shrink(type(sub), kind)
    return config_class(**kwargs)


@functools.lru_cache(maxsize=None)
def _tiny_config(family: str, kind: str, class_name: str):
    return _shrink(_config_class(family, class_name), kind)


def _has_experts(config) -> bool:
    return any(isinstance(getattr(config, n, None), int) and getattr(config, n) > 1 for n in EXPERT_COUNTS)


# ---------------------------------------------------------------------------------------------- survey


@functools.lru_cache(maxsize=None)
def _survey() -> tuple[tuple[ZooCase, ...], tuple[tuple[str, str], ...]]:
    """Try every candidate once per process: the cases that run and the reasons for the others."""
    cases, skips, claimed = [], [], {}
    for family, kind, class_name in _ordered(_candidates()):
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
        reason = _not_generic(family, kind, class_name)
        if reason:
            return reason
        if owner := _alias_of(family, class_name, claimed):
            return f"same model class and config class as {owner}"
        if kind == "decoder" and _has_experts(_config_class(family, class_name)()):
            kind = "moe"
        case = ZooCase(family, kind, class_name)
        _check(case)
        return case
    except Exception as error:  # noqa: BLE001 - every failure becomes a skip reason
        return _first_line(error)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _check(case: ZooCase) -> None:
    with torch.device("meta"):
        size = sum(p.numel() for p in case.build().parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"still {size / 1e6:.0f}M parameters after shrinking")
    args, kwargs = case.inputs()
    with torch.no_grad():
        case.build()(*args, **kwargs)

