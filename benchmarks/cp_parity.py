"""Context-parallel parity matrix: every cp mesh and model against one device.

``make cp-parity`` (``python benchmarks/cp_parity.py``): 4 gloo CPU ranks, one launch. Models:
this project's example Llama and Hugging Face Llama, Qwen2 and Mistral, unmodified (2 blocks,
width 64, 4 heads over 2 kv heads, random weights), and Hugging Face Llama computing its own loss
from ``labels``. Meshes ``cp4``, ``dp2 x cp2`` and ``cp2 x tp2``; a global batch of 4 sequences of
64 tokens. Each configuration trains twice next to one device on the same batches: 3 AdamW steps
(the largest relative loss difference) and 3 SGD steps (the largest relative parameter difference
after them). The goal is <= 1e-5 for both. Results go to ``benchmarks/results/cp_parity.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MESHES = {"cp4": ((4,), ("cp",)), "dp2 x cp2": ((2, 2), ("dp", "cp")), "cp2 x tp2": ((2, 2), ("cp", "tp"))}
BATCH, SEQ = 4, 64


def _models():
    import transformers as hf

    from examples.models import Llama, LlamaConfig
    from tests.hf_cases import _DECODER

    config = {**_DECODER, "max_position_embeddings": SEQ}
    return {
        "example Llama": lambda: Llama(LlamaConfig(max_seq_len=SEQ)),
        "HF Llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**config)),
        "HF Qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**config)),
        "HF Mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**config)),
        "HF Llama, labels": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**config)),
    }


def _own_loss(output, targets):
    return output.loss


def _rank(rank: int, world: int) -> list[dict]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tests.hf_cases import VOCAB
    from tests.parity import hf_loss, lm_loss, train_both

    meshes = {name: init_device_mesh("cpu", shape, mesh_dim_names=names) for name, (shape, names) in MESHES.items()}
    rows = []
    for model_name, build in _models().items():
        loss_fn = lm_loss if model_name == "example Llama" else _own_loss if "labels" in model_name else hf_loss
        for mesh_name, mesh in meshes.items():
            row = {"model": model_name, "mesh": mesh_name}
            start = time.perf_counter()
            try:
                errors = {}
                for optimizer in ("adamw", "sgd"):
                    torch.manual_seed(0)
                    model = build()
                    vocab = 256 if model_name == "example Llama" else VOCAB
                    ids = torch.randint(0, vocab, (BATCH, SEQ))
                    targets = torch.randint(0, vocab, (BATCH, SEQ))
                    kwargs = {"labels": targets} if "labels" in model_name else None
                    errors[optimizer] = train_both(model, mesh, ids, targets, loss_fn, optimizer=optimizer,
                                                   kwargs=kwargs)
                row |= {"loss_error": max(abs(a - b) / abs(b) for a, b in errors["adamw"].losses),
                        "param_error": max(errors["sgd"].param_errors.values())}
            except Exception as err:  # noqa: BLE001  (a row per configuration, whatever happens)
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
    return rows


def main() -> None:
    from autoshard.adapters.launch import spawn

    rows = spawn(_rank, 4)[0]
    print(f"{'model':<18} {'mesh':<10} {'loss (AdamW)':>13} {'params (SGD)':>13}")
    passed = 0
    for row in rows:
        if "error" in row:
            print(f"{row['model']:<18} {row['mesh']:<10}  {row['error']}")
            continue
        ok = row["loss_error"] <= 1e-5 and row["param_error"] <= 1e-5
        passed += ok
        print(f"{row['model']:<18} {row['mesh']:<10} {row['loss_error']:>13.1e} {row['param_error']:>13.1e}"
              + ("" if ok else "  > 1e-5"))
    print(f"{passed} of {len(rows)} configurations within 1e-5 of one device")
    out = os.path.join(ROOT, "benchmarks", "results", "cp_parity.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
