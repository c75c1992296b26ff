"""``autoshard.suggest_mesh`` in one process: given links and a compute rate, no probe runs.

The ranking against measured step times is the benchmark's job
(``benchmarks/bench_meshes.py``); here: every factorization is planned and
priced from its own plan, memory limits mark and demote candidates, HSDP
shapes appear when nodes are known, and what cannot run is said.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard import Links
from examples.models import Llama, LlamaConfig

TOKENS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
FAST = Links(intra_gbps=100.0, intra_latency_us=1.0)


def _llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_heads=4, num_kv_heads=4))


def test_every_factorization_is_priced_from_its_own_plan():
    suggestion = autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS,), links=FAST, flops_per_second=1e10,
                                        verbose=False)
    meshes = [c.mesh for c in suggestion.candidates]
    flat = [m for m in meshes if "pp" not in m]
    assert sorted(map(str, flat)) == sorted(map(str, [{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4}]))
    steps = [c.step_s for c in suggestion.candidates]
    assert steps == sorted(steps) and suggestion.best == meshes[0]
    for candidate in (c for c in suggestion.candidates if "pp" not in c.mesh):
        plan = autoshard.plan(_llama(), candidate.mesh, example_inputs=(TOKENS[: 8 // candidate.mesh.get("dp", 1)],))
        assert set(candidate.comm_s) == set(plan.predicted_comm())
        assert candidate.compute_s > 0 and candidate.memory_bytes > 0
    # tp splits the matmuls, dp the batch: compute per rank is about a quarter on every mesh
    computes = {str(c.mesh): c.compute_s for c in suggestion.candidates if "pp" not in c.mesh}
    assert max(computes.values()) < 1.5 * min(computes.values())
    assert "rank  mesh" in str(suggestion)


def test_pipeline_meshes_are_priced_too():
    """pp x dp x tp shapes, 1F1B over twice as many microbatches as stages: the busiest pp rank's FLOPs
    over microbatches + pp - 1 slots, the plan's pp sends on the link, the largest stage's memory;
    4 stages of a 2-block model are skipped, and said."""
    suggestion = autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS,), links=FAST, flops_per_second=1e10,
                                        verbose=False)
    pp = {str(c.mesh): c for c in suggestion.candidates if "pp" in c.mesh}
    assert set(pp) == {str({"pp": 2, "dp": 2}), str({"pp": 2, "tp": 2})}
    for candidate in pp.values():
        assert "pp" in candidate.comm_s and candidate.comm_s["pp"] > 0 and candidate.compute_s > 0
    plan = autoshard.plan(_llama(), {"pp": 2, "tp": 2}, example_inputs=(TOKENS,), microbatches=4)
    busiest = max(s.flops for s in plan.pipeline.stages)
    assert pp[str({"pp": 2, "tp": 2})].compute_s == pytest.approx(busiest * (4 + 2 - 1) / 1e10)
    assert any("{'pp': 4}" in s and "4 pipeline stages" in s for s in suggestion.skipped)


def test_slow_links_favour_less_communication_and_memory_limits_demote():
    slow = Links(intra_gbps=0.001, intra_latency_us=1000.0)
    suggestion = autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS,), links=slow, flops_per_second=1e12,
                                        verbose=False)
    comm = {str(c.mesh): sum(c.comm_s.values()) for c in suggestion.candidates}
    assert str(suggestion.best) == min(comm, key=comm.get)
    smallest = min(c.memory_bytes for c in suggestion.candidates)
    limited = autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS,), links=slow, flops_per_second=1e12,
                                     memory_per_rank=smallest, verbose=False)
    fits = [c for c in limited.candidates if c.fits]
    assert fits and all(c.memory_bytes <= smallest for c in fits)
    assert limited.candidates[0].fits
    if len(fits) < len(limited.candidates):
        assert "(does not fit)" in str(limited) and not limited.candidates[-1].fits


def test_hsdp_shapes_when_nodes_are_known():
    links = Links(intra_gbps=100.0, inter_gbps=10.0, ranks_per_node=4)
    suggestion = autoshard.suggest_mesh(_llama(), 8, example_inputs=(TOKENS,), links=links, flops_per_second=1e10,
                                        verbose=False)
    meshes = [c.mesh for c in suggestion.candidates]
    assert {"dp_replicate": 2, "dp_shard": 2, "tp": 2} in meshes and {"dp_replicate": 2, "dp_shard": 4} in meshes
    hsdp = next(c for c in suggestion.candidates if c.mesh == {"dp_replicate": 2, "dp_shard": 4})
    assert set(hsdp.comm_s) == {"dp_shard", "dp_replicate"}


def test_a_batch_that_does_not_split_is_skipped_and_said():
    suggestion = autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS[:3],), links=FAST, flops_per_second=1e10,
                                        verbose=False)
    assert [c.mesh for c in suggestion.candidates] == [{"tp": 4}]
    assert any("batch 3 does not divide by 4" in s for s in suggestion.skipped)
    assert any("batch 3 does not divide by 2" in s for s in suggestion.skipped)


def test_without_links_or_a_process_group_it_says_what_to_pass():
    with pytest.raises(ValueError, match="pass links=autoshard.Links"):
        autoshard.suggest_mesh(_llama(), 4, example_inputs=(TOKENS,), verbose=False)


def test_a_model_built_on_meta_ranks_its_pipeline_candidates():
    """Hugging Face Llama built on meta (its rotary table made in a no-grad region, which every
    simulation now runs as plain ops): the pipeline shapes of 4 ranks are planned and priced, none
    skipped for an error (Llama-3-8B shapes over 64 ranks do the same, in about a minute)."""
    import transformers as hf

    config = hf.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, use_cache=False)
    with torch.device("meta"):
        model = hf.LlamaForCausalLM(config)
    tokens = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
    suggestion = autoshard.suggest_mesh(model, 4, example_inputs=(tokens,), links=FAST, flops_per_second=1e12,
                                        verbose=False)
    pipelined = [c.mesh for c in suggestion.candidates if "pp" in c.mesh]
    assert {"pp": 2, "dp": 2} in pipelined and {"pp": 2, "tp": 2} in pipelined, pipelined
    assert all("does not divide" in s or "stages" in s for s in suggestion.skipped), suggestion.skipped
