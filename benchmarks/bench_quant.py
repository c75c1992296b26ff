"""Benchmark the block-quantized FSDP all-gather (``autoshard(..., all_gather_quant=BlockQuant(...))``).

``python benchmarks/bench_quant.py`` (from the repo root; ``make bench-quant``) prints three tables
and writes them to JSON (``benchmarks/results/bench_quant.json`` unless ``--out``):

(a) **Wire bytes and step time**, side by side in one run on a ("dp", "tp") = (2, 2) gloo mesh of
    4 local CPU processes: a 4-block Llama of width 256 (tiles 128x128, blocks 64x64) in fp32,
    bf16 mixed precision, and fp8 / int8 blocks on top of each. Per variant: dp all-gather wire
    bytes per training step (forward + backward + AdamW, counted by ``CollectiveCounter``), the
    ratio to its unquantized base, and the median step time over ``--steps`` timed steps (max
    over ranks, after a barrier). Variants run in one process group, in turn, each on the same
    weights and batches.
(b) **Loss curves**: 50 AdamW steps of the demo model (``examples/train_llama.py``'s config,
    its learnable token rule, blocks 16x16) unquantized vs fp8 vs int8, every 10th step and the
    largest relative gap.
(c) **Alignment** on meta, no process group: for Llama-3 8B and 70B shapes, each mesh with
    ``dp`` in 8..1024 and ``tp`` in 1..8, how many linear weights keep whole 128x128 blocks per
    rank in autoshard's layout (tile ``[in/dp, out/tp]``) and in the hand-written one (colwise
    ``[out, in]`` cut on dim 0 by both axes: a slab ``[out/(dp*tp), in]``; rowwise
    ``[out/dp, in/tp]``), and the largest ``dp*tp`` at which every linear weight still does.
    autoshard's column comes from ``autoshard.plan`` of the meta model (the same decision
    ``autoshard`` applies); the hand-written column from the same shapes by the rule above.

CPU step times say little about a GPU; the bytes are what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

import autoshard  # noqa: E402
from autoshard import BlockQuant  # noqa: E402
from autoshard.adapters.comm_stats import CollectiveCounter  # noqa: E402
from autoshard.adapters.launch import spawn  # noqa: E402
from examples.models import Llama, LlamaConfig  # noqa: E402

WIDE = LlamaConfig(vocab_size=512, dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden=512)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
VARIANTS = {  # name -> (mp_policy, all_gather_quant); each quantized one is compared with its base
    "fp32": (None, None),
    "fp32 + fp8 64x64": (None, BlockQuant(torch.float8_e4m3fn, 64)),
    "fp32 + int8 64x64": (None, BlockQuant(torch.int8, 64)),
    "bf16": (BF16, None),
    "bf16 + fp8 64x64": (BF16, BlockQuant(torch.float8_e4m3fn, 64)),
    "bf16 + int8 64x64": (BF16, BlockQuant(torch.int8, 64)),
}
CURVES = {"unquantized": None, "fp8 16x16": BlockQuant(torch.float8_e4m3fn, 16),
          "int8 16x16": BlockQuant(torch.int8, 16)}
LLAMA3 = {  # name -> (dim, ffn hidden, heads, kv heads, vocab)
    "Llama-3 8B": (4096, 14336, 32, 8, 128256),
    "Llama-3 70B": (8192, 28672, 64, 8, 128256),
}


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _local(tensor, mesh):
    index, count = autoshard.data_parallel_rank(mesh)
    return tensor.chunk(count)[index]


# --- (a) and (b): one process group ------------------------------------------------------------


def _measure(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, WIDE.vocab_size, (8, 65), generator=gen) for _ in range(steps + 2)]
    table = {}
    for name, (policy, quant) in VARIANTS.items():
        torch.manual_seed(0)
        model = Llama(WIDE)
        sharded = autoshard.autoshard(model, mesh, example_inputs=(_local(batches[0][:, :-1], mesh),),
                                      mp_policy=policy, all_gather_quant=quant)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        times = []
        for step, batch in enumerate(batches):
            tokens, targets = _local(batch[:, :-1], mesh), _local(batch[:, 1:], mesh)
            counting = step == 1
            counter = CollectiveCounter({a: mesh.get_group(a) for a in ("dp", "tp")}) if counting else None
            dist.barrier()
            start = time.perf_counter()
            if counter:
                counter.__enter__()
            _lm_loss(sharded(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            if counter:
                counter.__exit__(None, None, None)
                gathered = counter.wire_bytes("dp", "all_gather")
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 2:
                times.append(elapsed.item())
        table[name] = {"dp_all_gather_bytes": gathered, "step_ms": 1000 * statistics.median(times)}
    return {"wire": table, "curves": _curves(mesh)}


def _curves(mesh) -> dict[str, list[float]]:
    from examples.train_llama import CONFIG, token_rule

    rule = token_rule(0)
    gen = torch.Generator().manual_seed(1)
    curves = {}
    for name, quant in CURVES.items():
        torch.manual_seed(0)
        model = Llama(CONFIG)
        tokens = torch.empty(8, 33, dtype=torch.long)
        sharded = autoshard.autoshard(model, mesh, example_inputs=(_local(tokens[:, :-1], mesh),),
                                      all_gather_quant=quant)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=3e-3)
        gen.manual_seed(1)
        losses = []
        for _ in range(50):
            tokens[:, 0] = torch.randint(CONFIG.vocab_size, (8,), generator=gen)
            for t in range(32):
                tokens[:, t + 1] = rule[tokens[:, t]]
            loss = _lm_loss(sharded(_local(tokens[:, :-1], mesh)), _local(tokens[:, 1:], mesh))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=mesh.get_group("dp"))
            losses.append(total.item() / mesh["dp"].size())
        curves[name] = losses
    return curves


# --- (c): alignment on meta --------------------------------------------------------------------


def _meta_llama(dim: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=vocab, dim=dim, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                                 ffn_hidden=hidden, max_seq_len=16))


def _hand_written_fits(shape: tuple[int, int], colwise: bool, dp: int, tp: int, block: int) -> bool:
    """The hand-written layout of a weight ``[out, in]``: colwise cut on dim 0 by tp then dp (one
    slab of out/(dp*tp) rows), rowwise tp on dim 1 and dp on dim 0."""
    out_features, in_features = shape
    rows, cols = (out_features, dp * tp), (in_features, 1)
    if not colwise:
        rows, cols = (out_features, dp), (in_features, tp)
    fits = [size % parts == 0 and (size // parts) % block == 0 for size, parts in (rows, cols)]
    return all(fits)


def alignment(block: int = 128) -> dict:
    """Per model and mesh: linear weights (per block, plus the LM head) that keep whole blocks."""
    spec = BlockQuant(torch.float8_e4m3fn, block)
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    result = {}
    for name, shapes in LLAMA3.items():
        model = _meta_llama(*shapes)
        base = autoshard.plan(model, {"dp": 8, "tp": 8}, example_inputs=(tokens,), all_gather_quant=spec)
        linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        rows = []
        for tp in (1, 2, 4, 8):
            for dp in (8, 16, 32, 64, 128, 256, 512, 1024):
                plan = base.for_mesh({"dp": dp, "tp": tp})
                ours = {f for f in linears if plan.params[f].gather.quantized}
                theirs = {f for f, m in linears.items()
                          if _hand_written_fits(tuple(m.weight.shape), plan.params[f].role == "colwise", dp, tp, block)}
                rows.append({"dp": dp, "tp": tp, "autoshard": len(ours), "hand_written": len(theirs),
                             "autoshard_blocks_only": len(ours - {"output.weight"}),
                             "hand_written_blocks_only": len(theirs - {"output.weight"})})
        total = len(linears)
        largest = {k: max((r["dp"] * r["tp"] for r in rows if r[k] == total), default=0)
                   for k in ("autoshard", "hand_written")}
        largest |= {f"{k}_blocks_only": max((r["dp"] * r["tp"] for r in rows if r[f"{k}_blocks_only"] == total - 1),
                                            default=0) for k in ("autoshard", "hand_written")}
        result[name] = {"linear_weights": total, "rows": rows, "largest_world_all_fit": largest}
    return result


# --- report ------------------------------------------------------------------------------------


def report(measured: dict, aligned: dict) -> str:
    lines = ["(a) dp all-gather wire bytes per step and step time, 2x2 gloo, width-256 4-block Llama",
             f"{'variant':<20} {'dp all-gather B':>16} {'vs base':>8} {'step ms':>8}"]
    wire = measured["wire"]
    for name, row in wire.items():
        base = wire["bf16" if name.startswith("bf16") else "fp32"]["dp_all_gather_bytes"]
        lines.append(f"{name:<20} {row['dp_all_gather_bytes']:>16,} {row['dp_all_gather_bytes'] / base:>8.3f} "
                     f"{row['step_ms']:>8.1f}")
    lines += ["", "(b) loss of the demo model, 50 AdamW steps, 2x2 (every 10th step)"]
    curves = measured["curves"]
    lines.append(f"{'step':>4} " + " ".join(f"{n:>12}" for n in curves))
    for step in (0, 9, 19, 29, 39, 49):
        lines.append(f"{step + 1:>4} " + " ".join(f"{c[step]:>12.4f}" for c in curves.values()))
    base = curves["unquantized"]
    for name, curve in curves.items():
        if name != "unquantized":
            gap = max(abs(a - b) / abs(b) for a, b in zip(curve, base, strict=True))
            lines.append(f"largest relative gap to unquantized, {name}: {gap:.2e}")
    lines += ["", "(c) linear weights keeping whole 128x128 blocks per rank: autoshard / hand-written"]
    for name, data in aligned.items():
        lines.append(f"{name} ({data['linear_weights']} linear weights: one block's 7 and the LM head)")
        dps = sorted({r["dp"] for r in data["rows"]})
        lines.append("tp\\dp " + " ".join(f"{dp:>7}" for dp in dps))
        for tp in (1, 2, 4, 8):
            cells = [r for r in data["rows"] if r["tp"] == tp]
            lines.append(f"{tp:>5} " + " ".join(f"{r['autoshard']:>3}/{r['hand_written']:<3}" for r in cells))
        largest = data["largest_world_all_fit"]
        lines.append(f"largest dp*tp with every weight whole: autoshard {largest['autoshard']}, "
                     f"hand-written {largest['hand_written']}; with the 7 block weights whole (the LM head's "
                     f"vocabulary 128256 aside): autoshard {largest['autoshard_blocks_only']}, "
                     f"hand-written {largest['hand_written_blocks_only']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (default: 8)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_quant.json"))
    args = parser.parse_args()
    aligned = alignment()
    measured = spawn(_measure, 4, (args.steps,))[0]
    print(report(measured, aligned))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"measured": measured, "alignment": aligned}, f, indent=1)


if __name__ == "__main__":
    main()
