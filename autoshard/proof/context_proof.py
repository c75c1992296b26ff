"""Prove a graph cut over cp in one process: every cp rank run side by side, against the unsharded graph.

The cp ranks run as :class:`~autoshard.proof.simulate.RankSimulator` runs tp ranks: every value is
one tensor per rank, the cp collectives combine the ranks' values as the real ones do. Each rank is
given the whole batch (as in a real job) and back-propagates the same output cotangents, so the sum
over ranks of a parameter's gradients is ``cp`` times the unsharded gradient (FSDP's average over
``dp x cp`` divides it back, see :mod:`autoshard.runtime.context_ops`). Every output on every rank and every
parameter gradient (summed over ranks, divided by cp) is compared with the unsharded run.

Weights are the model's own (copies) and the inputs are the example's: the rewrite's correctness
depends on positions and shapes, not on values, and the model's weights keep its numerics.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.core.errors import describe
from autoshard.core.mesh import CP, TP
from autoshard.plans.predict import Tally
from autoshard.proof.proof import TOLERANCE, Proof, _typical_rms, rel_error, stored_shards
from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.rounding import Measure
from autoshard.proof.simulate import PerRank, RankSimulator, widened
from autoshard.runtime.context_ops import CP_CAUSAL_ATTENTION, local_positions


def prove_context(reference: fx.GraphModule, cut: fx.GraphModule, cp: int, inputs: list, weights: dict,
                  *, seed: int = 0, rtol: float | None = None, output_cuts: tuple = (), seq: int = 0,
                  plan=None, tp: int = 1) -> Proof:
    """Run ``cut`` on ``cp`` (x ``tp``) simulated ranks and ``reference`` on one, on flat ``inputs`` and
    ``weights`` (``get_attr`` target or FQN -> tensor); compare outputs and gradients.

    ``output_cuts``: per output, the dim it leaves cut along (each rank compared with its positions of
    the reference), or None. With ``plan`` and ``tp``, ``cut`` is the tp code emitted for the graph cut
    over cp: each rank holds the plan's tp shard of every parameter (rank ``i`` is cp rank ``i // tp``,
    tp rank ``i % tp``), and a tp rank's gradients summed over cp are held to its shard of the
    reference's.

    A model computing in bf16 or fp16 is run a second time in float64 (every dtype the code names
    widened): cutting the sequence reorders sums, which rounds differently in 16 bits, so the plan is
    judged by the float64 run (``Measure.sharded``, held to 1e-9), its 16-bit error kept beside it."""
    start = time.perf_counter()
    floating = [w.dtype for w in weights.values() if w.is_floating_point() and w.requires_grad] or [torch.float32]
    dtype = min(floating, key=lambda d: torch.finfo(d).bits)  # the narrowest the model computes in
    tolerance = rtol if rtol is not None else TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    run = _Ranks(reference, cut, cp, tp, plan, output_cuts, seq)
    trained = {name for name, w in weights.items() if w.is_floating_point() and w.requires_grad}
    errors, tally = run.errors(inputs, weights, trained, seed, widen=None)
    wide = None
    if rtol is None and torch.finfo(dtype).bits < 32:
        wide, _ = run.errors(inputs, weights, trained, seed, widen=torch.float64)
    measures = [Measure(what, error, allowed=tolerance) if wide is None else
                Measure(what, error, sharded=wide[what], allowed=WIDE_TOLERANCE) for what, error in errors.items()]
    result = tally.result()
    first = None if all(m.ok for m in measures) else _first_divergence(run, tolerance)
    return Proof(tp, tolerance if wide is None else WIDE_TOLERANCE,
                 tuple(m for m in measures if m.what.startswith("output")),
                 tuple(m for m in measures if m.what.startswith("grad")), first, time.perf_counter() - start,
                 result.get(TP, {}), exact="float64" if wide is not None else "", cp=cp,
                 cp_collectives=result.get(CP, {}))


WIDE_TOLERANCE = 1e-9  # a cut computing the model's function agrees with it to float64's rounding


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """One comparison of the simulated ranks with the unsharded graph (see :func:`prove_context`)."""

    reference: fx.GraphModule
    cut: fx.GraphModule
    cp: int
    tp: int
    plan: object
    output_cuts: tuple
    seq: int
    values: dict = dataclasses.field(default_factory=dict)  # each simulator's node values, by name, once run

    @property
    def grid(self) -> RankGrid:
        return RankGrid.of(cp=self.cp, tp=self.tp)

    def per_tp_rank(self, name: str, full: torch.Tensor) -> list[torch.Tensor]:
        if self.plan is not None and name in self.plan.params:
            return stored_shards(self.plan.params[name], full, self.tp)
        return [full] * self.tp

    def errors(self, inputs: list, weights: dict, trained: set, seed: int,
               widen: torch.dtype | None) -> tuple[dict, Tally]:
        """``{"output i" / "grad fqn": relative error}`` and the collectives the ranks ran; ``trained``:
        the weights whose gradients are compared; ``widen``: every float computed in that dtype."""
        cp, tp = self.cp, self.tp
        weights = {name: widened(w.detach(), widen) for name, w in weights.items()}
        ref_params = {name: PerRank([w.clone().requires_grad_(name in trained)]) for name, w in weights.items()}
        grid = self.grid
        cp_params = {name: PerRank([self.per_tp_rank(name, w)[grid.coordinate(i, TP)].clone()
                                    .requires_grad_(name in trained) for i in grid]) for name, w in weights.items()}
        inputs = [widened(x, widen) for x in inputs]
        ref_sim = RankSimulator(self.reference, 1, ref_params.get, widen=widen)
        ref_out = _flat(ref_sim.run(*inputs))
        tally = Tally()
        cut_sim = RankSimulator(self.cut, tp, cp_params.get, tally=tally, widen=widen, cp=cp)
        cut_out = _flat(cut_sim.run(*inputs))
        self.values["reference"], self.values["cut"] = ref_sim.values, cut_sim.values
        gen = torch.Generator().manual_seed(seed)
        cotangents = [torch.randn(o.values[0].shape, generator=gen).to(o.values[0].dtype)
                      if isinstance(o, PerRank) and o.values[0].is_floating_point() else None for o in ref_out]
        cuts = list(self.output_cuts) + [None] * (len(ref_out) - len(self.output_cuts))
        positions = [local_positions(r, cp, self.seq) for r in range(cp)] if any(c is not None for c in cuts) else []

        # an output left cut over tp (loss parallelism): each tp rank holds its chunk of the last dim
        tp_dims = [o.sharded_dim if isinstance(o, PerRank) else None for o in cut_out]

        def on_rank(value, i, rank):  # the part of a whole value simulated rank ``rank`` holds of output ``i``
            if value is None:
                return None
            if cuts[i] is not None:
                value = value.index_select(cuts[i], positions[grid.coordinate(rank, CP)])
            return value if tp_dims[i] is None else value.chunk(tp, dim=tp_dims[i])[grid.coordinate(rank, TP)]

        _backward(ref_out, [[c] for c in cotangents])
        _backward(cut_out, [[on_rank(c, i, r) for r in range(cp * tp)] for i, c in enumerate(cotangents)])
        errors = {}
        for i, (ref, got) in enumerate(zip(ref_out, cut_out, strict=True)):
            if isinstance(ref, PerRank) and isinstance(ref.values[0], torch.Tensor):
                errors[f"output {i}"] = max(_rel(g.detach(), on_rank(ref.values[0].detach(), i, r))
                                            for r, g in enumerate(got.values))
        # a gradient zero in exact arithmetic (a key bias under softmax) is rounding noise on both sides:
        # held to a floor of a tenth of the model's typical gradient, as the tp proof does
        floor = 0.1 * _typical_rms([ref_params[name].values[0].grad for name in trained])
        for name, ref_grad, grads in compared_gradients(ref_params, cp_params, trained, weights):
            expected = self.per_tp_rank(name, ref_grad)
            scale = ref_grad.double().norm().item()
            worst = 0.0
            for t in range(tp):
                mine = [g for g in (grads[r] for r in grid.ranks_where(tp=t)) if g is not None]
                total = sum(mine) / cp if mine else torch.zeros_like(expected[t])
                worst = max(worst, rel_error(total, expected[t], scale, floor))
            errors[f"grad {name}"] = worst
        return errors, tally


def compared_gradients(ref_params: dict, rank_params: dict, trained: set, weights: dict):
    """``(name, reference gradient, each simulated rank's gradient)`` of every trained weight, in the
    weights' order; a weight no path reached on any side is skipped, one reached only on the ranks is
    compared with a zero reference."""
    for name in sorted(trained, key=list(weights).index):
        ref_grad = ref_params[name].values[0].grad
        grads = [p.grad for p in rank_params[name].values]
        if ref_grad is None and all(g is None for g in grads):
            continue
        yield name, (ref_grad if ref_grad is not None else torch.zeros_like(weights[name])), grads


def _first_divergence(ranks: _Ranks, tolerance: float) -> str | None:
    """The first value the cut code computes, in the order it ran, whose value on some rank differs
    from the reference's at that rank's positions by more than ``tolerance`` (a node kept whole: from
    its whole value): where a broken cut (a dropped gather, two stage values swapped) first shows.
    Values inside the code's submodules (blocks, pipeline stages) are named by their node; values cut
    over tp as well are skipped."""
    reference, cut = ranks.values.get("reference", {}), ranks.values.get("cut", {})
    nodes, grid = _computing_nodes(ranks.cut), ranks.grid
    for key, got in cut.items():
        name = key.rsplit(".", 1)[-1]
        want, node = reference.get(name), nodes.get(name)
        if want is None or node is None or node.op == "get_attr" or not isinstance(want.values[0], torch.Tensor):
            continue  # a parameter is never cut over the sequence, and a tp shard of one is not compared
        whole = want.values[0].detach()
        if not whole.is_floating_point():
            continue
        for rank, value in enumerate(got.values):
            if not isinstance(value, torch.Tensor):
                break
            cp_rank = grid.coordinate(rank, CP)
            expected = _at_positions(whole, value.shape, cp_rank, ranks.cp, ranks.seq)
            if expected is None:
                break  # cut some other way (over tp): not compared
            if _rel(value.detach(), expected) > tolerance:
                return (f"{describe(node)}: its value on cp rank {cp_rank} differs from the reference's "
                        f"at that rank's positions (relative error {_rel(value.detach(), expected):.1e})")
    return None


def _computing_nodes(code: fx.GraphModule) -> dict[str, fx.Node]:
    """Every node that computes a value in ``code`` and the graphs it calls, by name (a value handed
    into a submodule is its placeholder there, and named by the node computing it)."""
    nodes: dict[str, fx.Node] = {}
    for module in code.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op in ("call_function", "call_method") or node.name not in nodes:
                    nodes[node.name] = node
    return nodes


def _at_positions(whole: torch.Tensor, shape, cp_rank: int, cp: int, seq: int) -> torch.Tensor | None:
    """``whole`` as cp rank ``cp_rank`` holds it: itself when the shapes agree, its positions along the
    one dim of ``seq`` entries ``cp`` times shorter (the sequence); None when the shapes differ
    otherwise (a tp shard, which may be ``cp`` times shorter too: tp and cp of one size)."""
    if tuple(whole.shape) == tuple(shape):
        return whole
    if whole.dim() != len(shape):
        return None
    dims = [d for d in range(whole.dim()) if whole.shape[d] != shape[d]]
    if len(dims) != 1 or whole.shape[dims[0]] != seq or seq != shape[dims[0]] * cp:
        return None
    return whole.index_select(dims[0], local_positions(cp_rank, cp, seq))


def _flat(out) -> list:
    return pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, PerRank))


def _backward(outputs: list, cotangents: list) -> None:
    """Back-propagate every rank's outputs against its cotangents (``cotangents[i][rank]``)."""
    total = None
    for out, cots in zip(outputs, cotangents, strict=True):
        if not isinstance(out, PerRank):
            continue
        for value, cot in zip(out.values, cots, strict=True):
            if cot is not None and value.requires_grad:
                term = (value.float() * cot.float()).sum()
                total = term if total is None else total + term
    if total is not None:
        total.backward()


def _rel(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    scale = expected.double().norm().item() if scale is None else scale
    diff = (actual.double() - expected.double()).norm().item()
    return diff / scale if scale > 0 else diff


@dataclasses.dataclass(frozen=True)
class AttentionWork:
    """Attention FLOPs each cp rank runs in one forward, read from the emitted code's SDPA calls:
    ``executed`` counts every (query, key) pair a call computes, ``useful`` only those its mask
    lets through (``4 * head_dim`` FLOPs per pair and head: scores and the weighted sum)."""

    executed: tuple[float, ...]
    useful: tuple[float, ...]

    @staticmethod
    def spread(values) -> float:
        """Largest deviation from the mean, relative to it."""
        mean = sum(values) / len(values)
        return max(abs(v - mean) for v in values) / mean

    @staticmethod
    def ratio(values) -> float:
        """Most over least."""
        return max(values) / min(values)


def attention_work(cut: fx.GraphModule, cp: int, inputs: list, weights: dict) -> AttentionWork:
    """Run ``cut`` on ``cp`` simulated ranks (no gradients) and count each rank's attention FLOPs."""
    executed, useful = [0.0] * cp, [0.0] * cp
    sdpa = torch.ops.aten.scaled_dot_product_attention.default

    class Counting(RankSimulator):
        def call_function(self, target, args, kwargs):
            if target is CP_CAUSAL_ATTENTION:  # chunk c reads (c + 1) L keys, the last L causally
                q = args[0].values[0]
                chunk, batch_heads = q.shape[-2] // 2, q.numel() // (q.shape[-2] * q.shape[-1])
                for rank in range(self.ranks):
                    for c in (rank, 2 * cp - 1 - rank):
                        executed[rank] += 4 * batch_heads * q.shape[-1] * chunk * (c + 1) * chunk
                        useful[rank] += 4 * batch_heads * q.shape[-1] * (c * chunk + (chunk + 1) / 2) * chunk
            if target is sdpa:
                from autoshard.proof.simulate import on_rank

                for rank in range(self.ranks):
                    a, k = on_rank(args, rank), on_rank(kwargs, rank)
                    q, key = a[0], a[1]
                    mask = a[3] if len(a) > 3 else k.get("attn_mask")
                    causal = a[5] if len(a) > 5 else k.get("is_causal", False)
                    pairs = q.shape[-2] * key.shape[-2]
                    batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
                    seen = pairs
                    if mask is not None:
                        seen = mask.expand(*q.shape[:-1], key.shape[-2]).float().sum().item() / batch_heads
                        if mask.dtype != torch.bool:
                            seen = (mask.expand(*q.shape[:-1], key.shape[-2]) > -torch.inf).float().sum().item() \
                                / batch_heads
                    elif causal:
                        seen = torch.ones(q.shape[-2], key.shape[-2]).tril().sum().item()
                    flops = 4 * batch_heads * q.shape[-1]
                    executed[rank] += flops * pairs
                    useful[rank] += flops * seen
            return super().call_function(target, args, kwargs)

    params = {name: PerRank([w.detach()] * cp) for name, w in weights.items()}
    with torch.no_grad():
        Counting(cut, 1, params.get, cp=cp).run(*inputs)
    return AttentionWork(tuple(executed), tuple(useful))
