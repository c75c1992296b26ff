"""Expert parallelism against tensor parallelism for the experts, on the same 4 ranks.

``make bench-ep`` (``python benchmarks/bench_ep.py``). The model is Hugging Face's Qwen3-MoE with
random weights: 2 blocks, hidden 256, 64 experts, top 8, a fine-grained expert hidden size of 64
(``moe_intermediate_size``), transformers' default experts implementation (a grouped GEMM over the
rows sorted by expert). A global batch of 8 sequences of 128 tokens is trained by 4 gloo CPU ranks
(one launch) as

* ``ep=4``: each rank a quarter of the batch, 16 whole experts per rank, the rows sent by all-to-all
  (the dense weights cut by FSDP over the same 4 ranks);
* ``tp=4``: every rank the whole batch, every expert's hidden size cut in 4 (the dense weights too).

Both run twice: with the model's own router, and with routing forced balanced (each token's 8 experts
chosen round-robin, so every rank sends every other the same rows): there the measured all-to-all
bytes must equal ``plan.predicted_comm()``'s, which assumes balance. Per layout: the median step time
(forward, backward, AdamW) after a warm-up step, the wire bytes per rank and step per axis (measured by
``CollectiveCounter``, predicted next to it), the experts' GEMM shapes, each rank's parameter and
gradient bytes and the activations it keeps for backward, and under the model's router the rows each rank's experts
received (the load imbalance).

This machine has 2 cores for 4 ranks: a step takes about the ranks' total work, so the step times
compare the work and communication each layout adds, not what 4 devices would take. Memory is given
as each rank's parameter and gradient bytes and the activations its forward keeps for backward
(``tests/parity.held_for_backward``). Results go to ``benchmarks/results/bench_ep.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DIM, LAYERS, EXPERTS, TOP_K, EXPERT_HIDDEN, VOCAB = 256, 2, 64, 8, 64, 1024
BATCH, SEQ, STEPS, WARMUP = 8, 128, 3, 1
LAYOUTS = {"ep=4": ("ep",), "tp=4": ("tp",)}


def _model(balanced: bool):
    import torch
    import transformers as hf
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    torch.manual_seed(0)
    config = hf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM, num_hidden_layers=LAYERS,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=EXPERTS,
                               num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_HIDDEN, decoder_sparse_step=1,
                               mlp_only_layers=[], norm_topk_prob=True, use_cache=False, max_position_embeddings=SEQ)
    model = hf.Qwen3MoeForCausalLM(config)
    if balanced:
        for module in model.modules():
            if isinstance(module, modeling_qwen3_moe.Qwen3MoeTopKRouter):
                module.forward = _balanced_router(module)
    return model


def _balanced_router(router):
    """The router's own logits and weights, its choice replaced by a round-robin one: token ``t``
    takes experts ``t*k .. t*k + k - 1`` (mod E), so every expert gets the same rows."""
    import torch
    import torch.nn.functional as F

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        tokens = hidden_states.shape[0]
        picks = (torch.arange(tokens)[:, None] * router.top_k + torch.arange(router.top_k)) % router.num_experts
        weights = probs.gather(1, picks)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
        return logits, weights, picks

    return forward


def _rank(rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.adapters.comm_stats import CollectiveCounter
    from tests.parity import held_for_backward

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for balanced in (True, False):
        for name, axes in LAYOUTS.items():
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=axes)
            index, count = autoshard.data_parallel_rank(mesh)
            local_in, local_tgt = inputs.chunk(count)[index], targets.chunk(count)[index]
            sharded = autoshard.autoshard(_model(balanced), mesh, example_inputs=(local_in,), check=False)
            optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
            groups = {axis: mesh.get_group(axis) for axis in axes}
            times, counter = [], None
            for step in range(WARMUP + STEPS):
                counter = CollectiveCounter(groups)
                dist.barrier()
                start = time.perf_counter()
                with counter:
                    logits = sharded(local_in).logits
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local_tgt.reshape(-1))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                dist.barrier()
                if step >= WARMUP:
                    times.append(time.perf_counter() - start)
            plan = sharded.autoshard_plan
            predicted = plan.predicted_comm(reshard_after_forward=True)
            local = [p.to_local() if hasattr(p, "to_local") else p for p in sharded.parameters()]
            held = sum(p.numel() * p.element_size() for p in local)
            rows.append({
                "layout": name, "routing": "balanced" if balanced else "model's router", "rank": rank,
                "step_s": statistics.median(times),
                "measured": {a: s.wire_bytes for a, s in counter.stats().items() if s.wire_bytes},
                "predicted": {a: sum(b for _, b in kinds.values()) for a, kinds in predicted.items()},
                "measured_ep_all_to_all": counter.wire_bytes("ep", "all_to_all") if "ep" in axes else 0,
                "predicted_ep_all_to_all": predicted.get("ep", {}).get("all_to_all", (0, 0))[1],
                "expert_gemms": _gemms(plan, name),
                "param_and_grad_bytes": 2 * held,
                "held_for_backward": held_for_backward(sharded, local_in),
                "expert_rows": counter.expert_rows()[:LAYERS],
            })
            del sharded, optimizer
    return rows


def _gemms(plan, layout: str) -> str:
    if plan.experts:
        return "; ".join(c.ep_gemm if c.choice == "ep" else c.dp_gemm for c in plan.experts[:1])
    rows = BATCH * SEQ * TOP_K // EXPERTS  # every tp rank runs every expert on the whole batch's rows
    return (f"{EXPERTS} experts per rank, each [{rows}, {DIM}] x [{DIM}, {2 * EXPERT_HIDDEN // 4}], "
            f"[{rows}, {EXPERT_HIDDEN // 4}] x [{EXPERT_HIDDEN // 4}, {DIM}]")


def main() -> None:
    from autoshard.adapters.launch import spawn

    per_rank = spawn(_rank, 4)
    rows = [row for ranks in per_rank for row in ranks]
    summary = []
    for routing in ("balanced", "model's router"):
        for name in LAYOUTS:
            mine = [r for r in rows if r["layout"] == name and r["routing"] == routing]
            first = mine[0]
            summary.append({
                "layout": name, "routing": routing,
                "step_s": max(r["step_s"] for r in mine),
                "measured_bytes_per_rank": first["measured"], "predicted_bytes_per_rank": first["predicted"],
                "ep_all_to_all_measured": [r["measured_ep_all_to_all"] for r in mine],
                "ep_all_to_all_predicted": first["predicted_ep_all_to_all"],
                "expert_gemms": first["expert_gemms"],
                "param_and_grad_bytes_per_rank": first["param_and_grad_bytes"],
                "held_for_backward_per_rank": max(r["held_for_backward"] for r in mine),
                "rows_per_expert_per_rank": [r["expert_rows"][0] if r["expert_rows"] else [] for r in mine],
            })
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "bench_ep.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for s in summary:
        print(f"{s['layout']:5} {s['routing']:15} step {s['step_s']:.3f} s  measured {s['measured_bytes_per_rank']}  "
              f"predicted {s['predicted_bytes_per_rank']}")
        print(f"      per rank: parameters and gradients {s['param_and_grad_bytes_per_rank']:,} B, activations "
              f"held for backward {s['held_for_backward_per_rank']:,} B")
        print(f"      experts: {s['expert_gemms']}")
        if s["ep_all_to_all_predicted"]:
            print(f"      ep all-to-all bytes per rank: measured {s['ep_all_to_all_measured']}, predicted "
                  f"{s['ep_all_to_all_predicted']}")
        loads = [sum(r) for r in s["rows_per_expert_per_rank"] if r]
        if loads:
            print(f"      rows received per rank (first MoE layer): {loads}; per expert on rank 0: "
                  f"{s['rows_per_expert_per_rank'][0]}")
    balanced = [s for s in summary if s["routing"] == "balanced" and s["ep_all_to_all_predicted"]]
    assert all(set(s["ep_all_to_all_measured"]) == {s["ep_all_to_all_predicted"]} for s in balanced), balanced


if __name__ == "__main__":
    main()
