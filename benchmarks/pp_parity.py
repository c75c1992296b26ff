"""Pipeline parity matrix: every schedule, mesh, model and microbatch count against one device.

``make pp-parity`` (``python benchmarks/pp_parity.py``): 8 gloo CPU ranks, one launch. Models:
this project's example Llama and Hugging Face Llama and Qwen2 (8 blocks, width 64, random
weights). Meshes ``pp2 x dp2 x tp2`` and ``pp4 x tp2``; schedules GPipe, 1F1B and
Interleaved1F1B (2 stages per rank); 4 and 8 microbatches. Each configuration trains twice next
to one device on the same global batches: 3 AdamW steps (the largest relative loss difference)
and 3 SGD steps (the largest relative parameter difference after them). The goal is <= 1e-5 for
both. Results go to ``benchmarks/results/pp_parity.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MESHES = {"pp2 x dp2 x tp2": ((2, 2, 2), ("pp", "dp", "tp")), "pp4 x tp2": ((4, 2), ("pp", "tp"))}
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
MICROBATCHES = (4, 8)
LAYERS = 8


def _models():
    import transformers as hf

    from examples.models import Llama, LlamaConfig
    from tests.hf_cases import _DECODER

    config = {**_DECODER, "num_hidden_layers": LAYERS}
    return {
        "example Llama": lambda: Llama(LlamaConfig(num_layers=LAYERS)),
        "HF Llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**config)),
        "HF Qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**config)),
    }


def _rank(rank: int, world: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.parity import hf_loss, lm_loss, train_pipeline_both

    meshes = {name: init_device_mesh("cpu", shape, mesh_dim_names=names) for name, (shape, names) in MESHES.items()}
    rows = []
    for model_name, build in _models().items():
        loss_fn = lm_loss if model_name == "example Llama" else hf_loss
        for mesh_name, mesh in meshes.items():
            for schedule in SCHEDULES:
                for microbatches in MICROBATCHES:
                    row = {"model": model_name, "mesh": mesh_name, "schedule": schedule,
                           "microbatches": microbatches}
                    start = time.perf_counter()
                    try:
                        adamw = train_pipeline_both(build, mesh, loss_fn, schedule=schedule,
                                                    microbatches=microbatches, optimizer="adamw")
                        sgd = train_pipeline_both(build, mesh, loss_fn, schedule=schedule,
                                                  microbatches=microbatches, optimizer="sgd")
                        row |= {"loss_error": max(abs(a - b) / abs(b) for a, b in adamw.losses),
                                "param_error": max(sgd.param_errors.values())}
                    except Exception as err:  # noqa: BLE001  (a row per configuration, whatever happens)
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    row["seconds"] = time.perf_counter() - start
                    rows.append(row)
    return rows


def main() -> None:
    from autoshard.adapters.launch import spawn

    rows = spawn(_rank, 8)[0]
    print(f"{'model':<14} {'mesh':<16} {'schedule':<16} {'mb':>3} {'loss (AdamW)':>13} {'params (SGD)':>13}")
    passed = 0
    for row in rows:
        if "error" in row:
            print(f"{row['model']:<14} {row['mesh']:<16} {row['schedule']:<16} {row['microbatches']:>3}  "
                  f"{row['error']}")
            continue
        ok = row["loss_error"] <= 1e-5 and row["param_error"] <= 1e-5
        passed += ok
        print(f"{row['model']:<14} {row['mesh']:<16} {row['schedule']:<16} {row['microbatches']:>3} "
              f"{row['loss_error']:>13.1e} {row['param_error']:>13.1e}" + ("" if ok else "  > 1e-5"))
    print(f"{passed} of {len(rows)} configurations within 1e-5 of one device")
    out = os.path.join(ROOT, "benchmarks", "results", "pp_parity.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
