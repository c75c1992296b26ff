"""A second corpus of model code: models written by libraries other than transformers.

``tests/zoo.py`` covers transformers' own model classes; this corpus covers code written
differently: fused q|k|v projections sliced or split by hand, ``einops`` rearranges,
``nn.MultiheadAttention``, complex and real rotary tables, tied embeddings, LoRA adapters
next to frozen base weights, adaLN-modulated diffusion blocks. Each case builds a fresh tiny
model with random weights (nothing is downloaded): width 64, 2 layers, 4 heads (2 kv heads
where the library has grouped-query attention), vocabulary 256, every dropout 0, inputs of
batch 2 and sequence 16 (16 patches for images and latents).

The libraries, each pinned in the Makefile's ``CORPUS_STAMP`` and installed with ``--no-deps``
(their dependency lists would replace the CPU torch, or pull CUDA wheels and data stacks).
Imports that are stubbed (an inert module answering every attribute, put in front of the
import system only in the process that builds that library's models), and why:

* ``torchvision`` for timm, open_clip and vit-pytorch: its wheel is compiled against a CUDA
  torch; these libraries import it for image transforms and detection ops the models do not call.
* ``datasets`` for torchtune: Hugging Face datasets (pyarrow, ...) imported by torchtune's
  data package at ``import torchtune``; the model builders never call it.
* ``lightning`` for litgpt: the Fabric/Trainer framework imported by ``litgpt/__init__`` and
  its checkpoint helpers; ``litgpt.model`` and ``litgpt.lora`` never call it.
* ``tyro``, ``torchtitan.distributed.minimal_async_ep.kernels`` and ``torchtitan.trainer`` for
  torchtitan (CLI parsing, triton MoE kernels, the launcher); ``benchmarks/bench_titan.py`` uses these too.

Every case has ``library``, ``name``, ``kind``, ``features``, ``build()`` (a fresh model, seeded)
and ``inputs()`` -> ``(args, kwargs)``. Models run as their library wrote them: no case wraps a
model's forward.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable

import torch

VOCAB, WIDTH, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 128, 2, 4, 2, 16
BATCH, SEQ, POSITIONS = 2, 16, 64
IMAGE, PATCH, CHANNELS, CLASSES = 32, 8, 3, 10  # 32x32 images in 8x8 patches: 16 patches
LORA_RANK, LORA_ALPHA = 8, 16
KINDS = ("decoder", "encoder", "vision", "multimodal", "diffusion")


# ------------------------------------------------------------------------------------------------ stubs

# library -> (stubbed top-level packages, stubbed modules)
STUBS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "timm": (("torchvision",), ()),
    "open_clip_torch": (("torchvision",), ()),
    "vit-pytorch": (("torchvision",), ()),
    "torchtune": (("datasets",), ()),
    "litgpt": (("lightning",), ()),
    "torchtitan": (("tyro",), ("torchtitan.distributed.minimal_async_ep.kernels",)),
}


class _Inert:
    """Any attribute of a stubbed module: callable, subscriptable, usable in ``X | Y`` annotations and
    as a base class; as a decorator it returns the function it decorates."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Inert:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Inert(f"{self._name}()")

    def __getitem__(self, key) -> _Inert:
        return self

    def __or__(self, other) -> _Inert:
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _InertModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the stubbed names before the real (missing or unusable) modules."""

    def __init__(self):
        self.packages: set[str] = set()
        self.modules: set[str] = set()

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.packages or name in self.modules:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _finder() -> _StubFinder:
    for finder in sys.meta_path:
        if isinstance(finder, _StubFinder):
            return finder
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    return finder


def install_stubs(library: str) -> None:
    """Put ``library``'s stubs (``STUBS``) in front of the import system; idempotent."""
    packages, modules = STUBS.get(library, ((), ()))
    if not packages and not modules and library != "torchtitan":
        return
    finder = _finder()
    finder.packages.update(packages)
    finder.modules.update(modules)
    if library == "torchtitan":
        sys.modules.setdefault("torchtitan.trainer", _titan_trainer_stub())


def _titan_trainer_stub() -> types.ModuleType:
    """``torchtitan.trainer`` with a ``Trainer.Config`` no config here is an instance of."""
    module = types.ModuleType("torchtitan.trainer")

    class Trainer:
        class Config:
            pass

    module.Trainer = Trainer
    return module


# ------------------------------------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class CorpusCase:
    library: str  # the PyPI distribution (pinned in the Makefile)
    name: str  # unique in the corpus
    kind: str  # one of KINDS
    features: tuple[str, ...]  # what the case covers: gqa, fused-qkv, tied, lora, rotary, ...
    builder: Callable[[], torch.nn.Module]
    make_inputs: Callable[[torch.Generator], tuple[tuple, dict]]

    def build(self, seed: int = 0) -> torch.nn.Module:
        """A fresh model with random weights (seeded) and every dropout at 0."""
        install_stubs(self.library)
        torch.manual_seed(seed)
        model = self.builder()
        _no_dropout(model)
        return model

    def inputs(self, seed: int = 0) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for one forward call."""
        install_stubs(self.library)
        return self.make_inputs(torch.Generator().manual_seed(seed))

    @property
    def id(self) -> str:
        return f"{self.library}:{self.name}"


def _no_dropout(model: torch.nn.Module) -> None:
    """Every dropout module at p=0 (belt and braces: each builder sets its config's dropouts to 0)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0


# ------------------------------------------------------------------------------------------------ inputs


def _tokens(gen: torch.Generator, low: int = 0, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(low, high, (BATCH, SEQ), generator=gen, dtype=torch.int64)


def _token_inputs(gen):
    return (_tokens(gen),), {}


def _padding_mask(dtype=torch.bool) -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=dtype)
    mask[::2, SEQ - 3:] = 0  # right padding on every other row
    return mask


def _image_inputs(gen):
    return (torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=gen),), {}


# ------------------------------------------------------------------------------------------------ timm


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH, depth=LAYERS,
                             num_heads=HEADS, mlp_ratio=FFN / WIDTH, qkv_bias=True)


def _timm_eva():
    from timm.models.eva import Eva

    return Eva(img_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH, depth=LAYERS, num_heads=HEADS,
               mlp_ratio=FFN / WIDTH, qkv_fused=True, swiglu_mlp=True, use_rot_pos_emb=True,
               ref_feat_shape=(IMAGE // PATCH, IMAGE // PATCH))


def _timm_vit_qknorm():
    """A ViT with q/k normalized per head (``qk_norm``), no qkv bias, a global average pool and no class token."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH, depth=LAYERS,
                             num_heads=HEADS, mlp_ratio=FFN / WIDTH, qkv_bias=False, qk_norm=True,
                             class_token=False, global_pool="avg")


# ---------------------------------------------------------------------------------------- x-transformers


def _xt_decoder_gqa():
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=POSITIONS, tie_embedding=True, use_abs_pos_emb=False,
                              attn_layers=Decoder(dim=WIDTH, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                                                  attn_kv_heads=KV_HEADS, rotary_pos_emb=True, ff_glu=True,
                                                  ff_mult=FFN // WIDTH, attn_dropout=0.0, ff_dropout=0.0))


def _xt_decoder_abs():
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=POSITIONS,
                              attn_layers=Decoder(dim=WIDTH, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                                                  ff_mult=FFN // WIDTH, attn_qk_norm=True, use_rmsnorm=True,
                                                  attn_dropout=0.0, ff_dropout=0.0))


def _xt_encoder():
    from x_transformers import Encoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=POSITIONS,
                              attn_layers=Encoder(dim=WIDTH, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                                                  ff_mult=FFN // WIDTH, attn_dropout=0.0, ff_dropout=0.0))


def _xt_encoder_inputs(gen):
    return (_tokens(gen),), {"mask": _padding_mask()}


# --------------------------------------------------------------------------------------------- torchtune


def _tune_llama3():
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=WIDTH,
                  max_seq_len=POSITIONS, intermediate_dim=FFN, attn_dropout=0.0)


def _tune_qwen2_tied():
    from torchtune.models.qwen2._component_builders import qwen2

    return qwen2(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=WIDTH,
                 intermediate_dim=FFN, max_seq_len=POSITIONS, attn_dropout=0.0, tie_word_embeddings=True)


def _tune_lora_llama3():
    """torchtune's LoRA recipe: LoRA on q, v and the MLP, only the adapters trainable."""
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    model = lora_llama3(["q_proj", "v_proj"], apply_lora_to_mlp=True, vocab_size=VOCAB, num_layers=LAYERS,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=WIDTH, max_seq_len=POSITIONS,
                        intermediate_dim=FFN, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0)
    set_trainable_params(model, get_adapter_params(model))
    return model


# ------------------------------------------------------------------------------------------------- peft


def _hf_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
                                      attention_dropout=0.0, use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _peft_lora_llama():
    """peft's LoRA on a transformers Llama (GQA): q/k/v/o adapters, base frozen by get_peft_model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    return get_peft_model(_hf_llama(), config)


def _peft_lora_gpt2():
    """peft's LoRA on GPT-2's fused ``c_attn`` (Conv1D, ``fan_in_fan_out``) and MLP; embeddings tied."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_inner=FFN, n_positions=POSITIONS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2))
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, fan_in_fan_out=True,
                        target_modules=["c_attn", "c_fc"], task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def _peft_lora_bert():
    """peft's LoRA on a BERT encoder (query, value), base frozen; padded inputs."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0), add_pooling_layer=False)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=["query", "value"])
    return get_peft_model(base, config)


def _attention_mask_inputs(gen):
    return (_tokens(gen),), {"attention_mask": _padding_mask(torch.int64)}


# ------------------------------------------------------------------------------------------- torchtitan


def titan_llama3_config(*, dim: int, n_heads: int, n_kv_heads: int, n_layers: int, hidden_dim: int, vocab: int,
                        seq: int):
    """torchtitan's Llama-3 config from its own helpers (fused ``wqkv``, complex RoPE sized to the
    sequence), with SDPA attention instead of flex; ``benchmarks/bench_titan.py`` builds from it too."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq, theta=500000, scaling="llama")
    layers = _build_llama3_layers(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  hidden_dim=hidden_dim, rope=rope, attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )


def _titan_llama3(kv_heads: int = KV_HEADS):
    """torchtitan's Llama-3 at the corpus's size."""
    model = titan_llama3_config(dim=WIDTH, n_heads=HEADS, n_kv_heads=kv_heads, n_layers=LAYERS, hidden_dim=FFN,
                                vocab=VOCAB, seq=SEQ).build()
    with torch.no_grad():
        model.init_weights()
    return model


def _titan_qwen3_tied():
    """torchtitan's Qwen3: fused ``wqkv``, per-head q/k RMSNorm, cos/sin RoPE, tied embeddings."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3 import __dict__ as qwen3

    layers = qwen3["_build_qwen3_layers"](n_layers=LAYERS, dim=WIDTH, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                          head_dim=HEAD_DIM, hidden_dim=FFN, attn_backend="flex",
                                          rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=WIDTH, norm=qwen3["_qwen3_norm"](WIDTH), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=WIDTH,
                                        param_init=qwen3["_EMBEDDING_INIT"]),
        lm_head=Linear.Config(in_features=WIDTH, out_features=VOCAB, param_init=qwen3["_LINEAR_INIT"]),
        layers=layers,
    )
    model = config.build()
    with torch.no_grad():
        model.init_weights()
    return model


# ------------------------------------------------------------------------------------------------ litgpt


def _litgpt_config(**kwargs) -> dict:
    """litgpt ``Config`` fields of the tiny size; ``kwargs`` set the layout."""
    base = dict(block_size=POSITIONS, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                n_embd=WIDTH, head_size=HEAD_DIM, rotary_percentage=1.0, intermediate_size=FFN)
    return base | kwargs


def _litgpt_pythia():
    """litgpt's GPT in the Pythia/NeoX layout: fused qkv, parallel residual, LayerNorm, GELU MLP, partial RoPE."""
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(**_litgpt_config(rotary_percentage=0.25, parallel_residual=True, bias=True,
                                       norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP")))


def _litgpt_llama():
    """litgpt's GPT in the Llama layout: fused qkv with 2 query groups (GQA), RMSNorm, SwiGLU."""
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(**_litgpt_config(n_query_groups=KV_HEADS, parallel_residual=False, bias=False,
                                       norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")))


def _litgpt_lora_llama():
    """litgpt's LoRA GPT (LoRA on the fused qkv's q and v parts and the projection), base frozen."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    config = Config(**_litgpt_config(n_query_groups=KV_HEADS, parallel_residual=False, bias=False,
                                     norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP"),
                    lora_r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, lora_query=True, lora_key=False,
                    lora_value=True, lora_projection=True)
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    return model


# ---------------------------------------------------------------------------------------------- open_clip


def _clip_text():
    """open_clip's text tower: ``nn.MultiheadAttention`` (fused in_proj), causal mask, EOT pooling, projection."""
    from open_clip.transformer import TextTransformer

    return TextTransformer(context_length=SEQ, vocab_size=VOCAB, width=WIDTH, heads=HEADS, layers=LAYERS,
                           mlp_ratio=FFN / WIDTH, output_dim=32)


def _clip_vision():
    from open_clip.transformer import VisionTransformer

    return VisionTransformer(image_size=IMAGE, patch_size=PATCH, width=WIDTH, layers=LAYERS, heads=HEADS,
                             mlp_ratio=FFN / WIDTH, output_dim=32)


def _clip():
    """The whole CLIP: both towers and the learned logit scale."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    vision = CLIPVisionCfg(layers=LAYERS, width=WIDTH, head_width=HEAD_DIM, mlp_ratio=FFN / WIDTH, patch_size=PATCH,
                           image_size=IMAGE)
    text = CLIPTextCfg(context_length=SEQ, vocab_size=VOCAB, width=WIDTH, heads=HEADS, layers=LAYERS,
                       mlp_ratio=FFN / WIDTH)
    return CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text)


def _clip_inputs(gen):
    return _image_inputs(gen)[0] + (_tokens(gen),), {}


# ----------------------------------------------------------------------------------------------- diffusers

LATENT, LATENT_CHANNELS, LATENT_PATCH = 8, 4, 2  # 8x8 latents in 2x2 patches: 16 tokens


def _dit():
    """diffusers' DiT: adaLN-Zero blocks conditioned on timestep and class label."""
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                                  in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=LAYERS,
                                  dropout=0.0, sample_size=LATENT, patch_size=LATENT_PATCH,
                                  num_embeds_ada_norm=CLASSES)
    # classifier-free guidance's label dropout (0.1, fixed by DiT's constructor) is a dropout too: off, or
    # every forward in training mode draws which labels to drop (torch.rand) and no two runs agree
    for module in model.modules():
        if type(module).__name__ == "LabelEmbedding":
            module.dropout_prob = 0.0
    return model


def _dit_inputs(gen):
    latents = torch.randn(BATCH, LATENT_CHANNELS, LATENT, LATENT, generator=gen)
    timestep = torch.randint(0, 1000, (BATCH,), generator=gen)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return (latents,), {"timestep": timestep, "class_labels": labels, "return_dict": False}


def _sd3():
    """diffusers' SD3 MMDiT: joint attention over latent and text tokens, separate q/k/v per stream."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=LATENT, patch_size=LATENT_PATCH, in_channels=LATENT_CHANNELS,
                                 num_layers=LAYERS, attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                 joint_attention_dim=WIDTH, caption_projection_dim=WIDTH, pooled_projection_dim=32,
                                 out_channels=LATENT_CHANNELS, pos_embed_max_size=LATENT)


def _sd3_inputs(gen):
    latents = torch.randn(BATCH, LATENT_CHANNELS, LATENT, LATENT, generator=gen)
    text = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
    pooled = torch.randn(BATCH, 32, generator=gen)
    timestep = torch.randint(0, 1000, (BATCH,), generator=gen)
    return (latents,), {"encoder_hidden_states": text, "pooled_projections": pooled, "timestep": timestep,
                        "return_dict": False}


# ------------------------------------------------------------------------------------------------ fair-esm


def _esm2():
    """ESM-2: rotary self-attention, pre-LayerNorm, LM head tied to the token embedding."""
    from esm.model.esm2 import ESM2

    return ESM2(num_layers=LAYERS, embed_dim=WIDTH, attention_heads=HEADS, alphabet="ESM-1b", token_dropout=True)


def _esm1b():
    """ESM-1b (``ProteinBertModel``, roberta_large arch): learned positions, tied LM head."""
    import argparse

    import esm
    from esm.model.esm1 import ProteinBertModel

    args = argparse.Namespace(arch="roberta_large", layers=LAYERS, embed_dim=WIDTH, ffn_embed_dim=FFN,
                              attention_heads=HEADS, max_positions=POSITIONS, dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0, final_bias=True)
    return ProteinBertModel(args, esm.Alphabet.from_architecture("ESM-1b"))


def _esm_inputs(gen):
    # ESM-1b's alphabet: 0 <cls>, 1 <pad>, 2 <eos>, 3 <unk>, 4..23 the 20 standard amino acids
    tokens = torch.randint(4, 24, (BATCH, SEQ), generator=gen)
    tokens[:, 0] = 0
    tokens[:, -1] = 2
    return (tokens,), {}


# -------------------------------------------------------------------------------------------- vit-pytorch


def _vit_pytorch():
    from vit_pytorch import ViT

    return ViT(image_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, dim=WIDTH, depth=LAYERS, heads=HEADS,
               mlp_dim=FFN, dim_head=HEAD_DIM, dropout=0.0, emb_dropout=0.0)


def _simple_vit():
    from vit_pytorch.simple_vit import SimpleViT

    return SimpleViT(image_size=IMAGE, patch_size=PATCH, num_classes=CLASSES, dim=WIDTH, depth=LAYERS, heads=HEADS,
                     mlp_dim=FFN, dim_head=HEAD_DIM)


# ------------------------------------------------------------------------------------------------- corpus

CASES: tuple[CorpusCase, ...] = (
    CorpusCase("timm", "vit", "vision", ("fused-qkv", "class-token"), _timm_vit, _image_inputs),
    CorpusCase("timm", "vit-qknorm-avgpool", "vision", ("fused-qkv", "qk-norm"), _timm_vit_qknorm,
               _image_inputs),
    CorpusCase("timm", "eva-rope-swiglu", "vision", ("fused-qkv", "rotary", "swiglu"), _timm_eva, _image_inputs),
    CorpusCase("x-transformers", "decoder-gqa-rotary-tied", "decoder", ("gqa", "rotary", "tied", "glu"),
               _xt_decoder_gqa, _token_inputs),
    CorpusCase("x-transformers", "decoder-qknorm-rmsnorm", "decoder", ("qk-norm", "abs-pos"), _xt_decoder_abs,
               _token_inputs),
    CorpusCase("x-transformers", "encoder-masked", "encoder", ("padding-mask",), _xt_encoder, _xt_encoder_inputs),
    CorpusCase("torchtune", "llama3-gqa", "decoder", ("gqa", "rotary"), _tune_llama3, _token_inputs),
    CorpusCase("torchtune", "qwen2-tied", "decoder", ("gqa", "tied", "qkv-bias"), _tune_qwen2_tied, _token_inputs),
    CorpusCase("torchtune", "lora-llama3", "decoder", ("gqa", "lora", "frozen-base"), _tune_lora_llama3,
               _token_inputs),
    CorpusCase("peft", "lora-llama", "decoder", ("gqa", "lora", "frozen-base"), _peft_lora_llama, _token_inputs),
    CorpusCase("peft", "lora-gpt2", "decoder", ("fused-qkv", "conv1d", "tied", "lora", "frozen-base"),
               _peft_lora_gpt2, _token_inputs),
    CorpusCase("peft", "lora-bert", "encoder", ("lora", "frozen-base", "padding-mask"), _peft_lora_bert,
               _attention_mask_inputs),
    CorpusCase("torchtitan", "llama3-gqa", "decoder", ("gqa", "fused-qkv", "complex-rotary"), _titan_llama3,
               _token_inputs),
    CorpusCase("torchtitan", "qwen3-tied", "decoder", ("gqa", "fused-qkv", "qk-norm", "tied"), _titan_qwen3_tied,
               _token_inputs),
    CorpusCase("litgpt", "pythia", "decoder", ("fused-qkv", "parallel-residual", "partial-rotary"), _litgpt_pythia,
               _token_inputs),
    CorpusCase("litgpt", "llama-gqa", "decoder", ("gqa", "fused-qkv", "rotary"), _litgpt_llama, _token_inputs),
    CorpusCase("litgpt", "lora-llama-gqa", "decoder", ("gqa", "fused-qkv", "lora", "frozen-base"),
               _litgpt_lora_llama, _token_inputs),
    CorpusCase("open_clip_torch", "text-tower", "encoder", ("mha-module", "causal-mask"), _clip_text,
               _token_inputs),
    CorpusCase("open_clip_torch", "vision-tower", "vision", ("mha-module",), _clip_vision, _image_inputs),
    CorpusCase("open_clip_torch", "clip", "multimodal", ("mha-module", "two-towers"), _clip, _clip_inputs),
    CorpusCase("diffusers", "dit", "diffusion", ("adaln", "class-conditioned"), _dit, _dit_inputs),
    CorpusCase("diffusers", "sd3-mmdit", "diffusion", ("joint-attention", "adaln"), _sd3, _sd3_inputs),
    CorpusCase("fair-esm", "esm2", "encoder", ("rotary", "tied"), _esm2, _esm_inputs),
    CorpusCase("fair-esm", "esm1b", "encoder", ("learned-positions", "tied"), _esm1b, _esm_inputs),
    CorpusCase("vit-pytorch", "vit", "vision", ("fused-qkv", "einops"), _vit_pytorch, _image_inputs),
    CorpusCase("vit-pytorch", "simple-vit", "vision", ("fused-qkv", "einops", "sincos-positions"), _simple_vit,
               _image_inputs),
)


def corpus_cases(libraries=None, kinds=None) -> list[CorpusCase]:
    """The cases, optionally only those of ``libraries`` / ``kinds`` (iterables of names)."""
    return [c for c in CASES
            if (not libraries or c.library in set(libraries)) and (not kinds or c.kind in set(kinds))]
