"""Every mesh the axis order allows on 8 ranks, proven in one process.

For each accepted mesh shape (``autoshard.core.mesh.MESH_SHAPES``: any of ``pp, dp_replicate,
dp_shard, dp, ep, cp, tp`` in that order, one data-parallel form) and every size of its axes (each at
least 2) whose product is 8, ``autoshard.check`` runs on three models: the example Llama, a
Hugging Face Llama and a Hugging Face Qwen2 (8 blocks, so that pp=8 has one per stage; 8 heads of
which 2 are kv heads, fewer than tp=4 and tp=8), and every mesh with an ``ep`` axis on three
mixtures of experts (``tests/moe_cases.py`` at 4 blocks, so that pp=4 has one per stage: Qwen3-MoE and
DeepSeek-V3 with 64 experts, top 8, DeepSeek-V3's first block dense, Mixtral with 8), in fp32 and in
bf16, and on every mesh with tp
also with sequence parallelism and with loss parallelism. bf16 is FSDP2's ``mp_policy``
(``param_dtype=bfloat16, reduce_dtype=float32``) where the mesh has an FSDP axis (dp, HSDP or cp),
else the model cast to bf16 (a tp- or pp-only mesh has no FSDP to cast it).

Each run is ``proven``, ``refused`` (its message, which must be one docs/limits.md lists),
``PROOF FAILED`` or ``INTERNAL``. The example input is the dp-local batch, 8 rows of 32 tokens
(cp=8 cuts 32 into 16 chunks of 2; pp=8 runs 8 microbatches of one row).

``python benchmarks/axis_matrix.py`` (``make axis-matrix``) writes
``benchmarks/results/axis_matrix.json`` and prints one line per run and a summary.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RANKS = 8
SIZES = (2, 4, 8)
TP_OPTIONS = ("plain", "sequence_parallel", "loss_parallel")
DTYPES = ("fp32", "bf16")
VOCAB, WIDTH, HEADS, KV_HEADS, FFN, LAYERS, BATCH, SEQ = 128, 64, 8, 2, 128, 8, 8, 32


def meshes(ranks: int = RANKS) -> list[dict[str, int]]:
    """Every accepted mesh of ``ranks`` ranks, each axis of at least 2, in the axis order."""
    from autoshard.core.mesh import MESH_SHAPES

    found = []
    for shape in MESH_SHAPES:
        for sizes in itertools.product(SIZES, repeat=len(shape)):
            if math.prod(sizes) == ranks:
                found.append(dict(zip(shape, sizes, strict=True)))
    return found


def _example_llama():
    from examples.models import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=VOCAB, dim=WIDTH, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                             ffn_hidden=FFN, max_seq_len=SEQ))


def _hf(kind: str):
    import transformers as hf

    config = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                  use_cache=False, tie_word_embeddings=False)
    if kind == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**config))
    return hf.Qwen2ForCausalLM(hf.Qwen2Config(**config))


def _moe(kind: str):
    from tests.moe_cases import MOE_MODELS

    return MOE_MODELS[kind](layers=4)  # pp=4 x ep=2 needs a block per stage


MODELS = {"example Llama": _example_llama, "HF Llama": lambda: _hf("llama"), "HF Qwen2": lambda: _hf("qwen2"),
          "HF Qwen3-MoE": lambda: _moe("qwen3_moe"), "HF Mixtral": lambda: _moe("mixtral"),
          "HF DeepSeek-V3": lambda: _moe("deepseek_v3")}
# the mixtures of experts run every mesh with an ep axis (the dense models every mesh without: ep on a
# model without experts is refused by design)
EXPERTS = {"HF Qwen3-MoE", "HF Mixtral", "HF DeepSeek-V3"}


def meshes_of(name: str, mesh_list: list[dict[str, int]]) -> list[dict[str, int]]:
    return [m for m in mesh_list if ("ep" in m) == (name in EXPERTS)]


def runs_of(mesh: dict[str, int]) -> list[str]:
    return list(TP_OPTIONS) if "tp" in mesh else ["plain"]


def _run_one(model, mesh: dict[str, int], dtype: str, option: str, tokens) -> dict:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import autoshard
    from autoshard.core.errors import InternalError
    from autoshard.core.mesh import axes_from_sizes

    row = {"mesh": mesh, "dtype": dtype, "option": option}
    keywords = {}
    if option != "plain":
        keywords[option] = True
    if dtype == "bf16":
        try:
            has_dp = axes_from_sizes(mesh).stage_axes().has_dp
        except NotImplementedError as err:  # a combination of axes not built yet: refused by name
            return row | {"status": "refused", "detail": str(err).splitlines()[0][:300], "seconds": 0.0}
        if has_dp:
            keywords["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            model = model.to(torch.bfloat16)
            row["cast"] = True
    start = time.perf_counter()
    try:
        proof = autoshard.check(model, mesh, example_inputs=(tokens,), **keywords)
        row["status"] = "proven" if proof.ok else "PROOF FAILED"
        row["detail"] = "" if proof.ok else str(proof).splitlines()[0][:300]
        row["max_error"] = max((m.error for m in (*proof.outputs, *proof.gradients)), default=0.0)
    except (InternalError, AssertionError) as err:
        row |= {"status": "INTERNAL", "detail": f"{type(err).__name__}: {str(err)[:300]}",
                "trace": traceback.format_exc()[-1500:]}
    except (ValueError, NotImplementedError) as err:
        refused = str(err).startswith("autoshard")
        row |= {"status": "refused" if refused else "INTERNAL", "detail": str(err).splitlines()[0][:300]}
        if not refused:
            row["trace"] = traceback.format_exc()[-1500:]
    except Exception as err:  # noqa: BLE001 - the matrix reports what a user would see
        row |= {"status": "INTERNAL", "detail": f"{type(err).__name__}: {str(err)[:300]}",
                "trace": traceback.format_exc()[-1500:]}
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _model_rows(name: str, dtype: str, mesh_list: list[dict[str, int]]) -> list[dict]:
    """Every run of one model in one dtype, in this process."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch

    torch.manual_seed(0)
    built = MODELS[name]()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    rows = []
    for mesh in meshes_of(name, mesh_list):
        for option in runs_of(mesh):
            row = _run_one(copy.deepcopy(built), mesh, dtype, option, tokens)
            row["model"] = name
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    mesh = " x ".join(f"{a}{n}" for a, n in row["mesh"].items())
    return (f"{row['model']:<14}{row['dtype']:<6}{mesh:<30}{row['option']:<19}{row['status']:<14}"
            f"{row['seconds']:>6.1f}s  {row.get('detail', '')[:120]}")


def summary(rows: list[dict]) -> list[str]:
    counts = collections.Counter(row["status"] for row in rows)
    lines = [f"axis matrix: {len({json.dumps(r['mesh']) for r in rows})} meshes of {RANKS} ranks, {len(rows)} runs: "
             + ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))]
    refusals = collections.Counter(row["detail"].split(":")[1].strip()[:90] if ":" in row["detail"] else row["detail"]
                                   for row in rows if row["status"] == "refused")
    for why, n in refusals.most_common():
        lines.append(f"  refused x{n}: {why}")
    for row in rows:
        if row["status"] not in ("proven", "refused"):
            lines.append(f"  {row['status']}: {_line(row)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "axis_matrix.json"))
    args = parser.parse_args()
    mesh_list = meshes()
    work = [(name, dtype, mesh_list) for name in args.models.split(",") for dtype in args.dtypes.split(",")]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        rows = [row for part in pool.starmap(_model_rows, work) for row in part]
    lines = summary(rows)
    import torch

    from benchmarks.corpus import _source

    version = f"autoshard {_source()}, torch {torch.__version__}"
    lines.append(f"({len(rows)} runs in {time.perf_counter() - start:.0f} s; {version}; "
                 f"{datetime.date.today().isoformat()})")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": lines, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["status"] in ("proven", "refused") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
