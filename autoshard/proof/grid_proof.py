"""Prove code cut over ep, cp and tp in one process: every rank of the ``ep x cp x tp`` grid run side by
side, against the unsharded graph.

The ranks run as :class:`~autoshard.proof.simulate.RankSimulator` runs them: every value is one tensor
per rank, each collective combines the ranks' values as the real one does within its axis' groups
(:class:`~autoshard.proof.rank_grid.RankGrid`). What each axis means for the comparison:

- **tp**: each rank holds the plan's shard of every parameter; an output left cut over tp (loss
  parallelism) is compared chunk by chunk; a gradient is held to the rank's shard of the reference's.
- **cp**: each rank takes the whole batch (as in a real job; the code keeps its positions) and
  back-propagates the same output cotangents, so the sum over cp ranks of a parameter's gradients is
  ``cp`` times the unsharded gradient (FSDP's average over ``dp x cp`` divides it back, see
  :mod:`autoshard.runtime.context_ops`); an output cut along the sequence is compared at the rank's
  positions.
- **ep**: ep ranks are data ranks that exchange rows, each routing its own tokens. So each ep
  coordinate gets a batch of its own (the example's for ep rank 0; for ep rank ``e`` the example rolled
  by ``e`` along its batch dim, or its last dim when the batch is one row, so the ranks route different
  rows and a source mixed up in the exchange shows), and the reference runs once per batch. A dense
  gradient is compared summed over ep with the reference's summed over the batches (FSDP's average
  over ``dp x ep`` times the ranks); an expert weight's gradient on its rank, times ep (its share, see
  :func:`autoshard.runtime.token_dispatch.ep_combine`), with its experts' rows of the reference's.

A model computing in 16 bits (its weights, or a matmul its code casts down to) is run a second time
widened, in float64 (held to float64's rounding), or in float32 where an op has no float64 kernel
(``torch._grouped_mm``), and judged by that run, its 16-bit errors kept beside: cutting a sum reorders
it, which rounds differently in 16 bits.

Weights are the model's own (copies) and the inputs are the example's: the rewrite's correctness
depends on positions, routing and shapes, not on values, and the model's weights keep its numerics.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.core.errors import describe
from autoshard.core.mesh import CP, EP, TP
from autoshard.plans.predict import Tally
from autoshard.proof.proof import TOLERANCE, Proof, _compute_dtype, _typical_rms, rel_error, stored_shards
from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.rounding import Measure
from autoshard.proof.simulate import EmittedCodeError, PerRank, RankSimulator, widened
from autoshard.runtime import token_dispatch
from autoshard.runtime.context_ops import local_positions

WIDE_TOLERANCE = 1e-9  # code computing the model's function agrees with it to float64's rounding


def prove_on_grid(reference: fx.GraphModule, code: fx.GraphModule, plan, grid: RankGrid, inputs: list,
                  weights: dict, *, seed: int = 0, rtol: float | None = None) -> Proof:
    """Run ``code`` on every rank of ``grid`` and ``reference`` once per ep rank's batch, on flat
    ``inputs`` (ep rank 0's) and ``weights`` (FQN -> tensor); compare outputs and gradients.

    With a cp axis the plan's record (``plan.context``) says how long the sequence is and which
    outputs leave cut along it (each cp rank compared with its positions of the reference)."""
    start = time.perf_counter()
    cut = plan.context
    run = _GridRun(reference, code, plan, grid, cut.output_cuts if cut is not None else (),
                   cut.seq if cut is not None else 0)
    dtype = _compute_dtype(weights, reference)  # a float32 model whose experts run in bf16 rounds in bf16
    tolerance = rtol if rtol is not None else TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    trained = {name for name, w in weights.items() if w.is_floating_point() and w.requires_grad}
    batches = [[_batch_of(x, e) for x in inputs] for e in range(grid.size(EP))]
    errors, tally = run.errors(batches, weights, trained, seed, widen=None)
    wide, exact, allowed = None, "", tolerance
    if rtol is None and torch.finfo(dtype).bits < 32:
        wide, exact, allowed = _wide_errors(run, batches, weights, trained, seed)
    measures = [Measure(what, error, allowed=tolerance) if wide is None else
                Measure(what, error, sharded=wide[what], allowed=allowed) for what, error in errors.items()]
    first = None if all(m.ok for m in measures) else _first_divergence(run, tolerance)
    result = tally.result()
    return Proof(grid.size(TP), allowed, tuple(m for m in measures if m.what.startswith("output")),
                 tuple(m for m in measures if m.what.startswith("grad")), first, time.perf_counter() - start,
                 result.get(TP, {}), plan=plan, exact=exact, cp=grid.size(CP), cp_collectives=result.get(CP, {}),
                 ep=grid.size(EP), ep_collectives=result.get(EP, {}))


def rank_shard(plan, grid: RankGrid, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What grid rank ``rank`` stores of weight ``name``: its tp shard, and its experts' rows of an
    expert split over ep (a weight the plan does not list, whole)."""
    local = full
    if plan is not None and name in plan.params:
        local = stored_shards(plan.params[name], full, grid.size(TP))[grid.coordinate(rank, TP)]
    if plan is not None and name in plan.ep_weights():
        local = local.chunk(grid.size(EP))[grid.coordinate(rank, EP)]
    return local


def _wide_errors(run: _GridRun, batches, weights, trained, seed):
    """The errors of a run with every float widened: float64 (held to float64's rounding), or float32
    where an op has no float64 kernel (``torch._grouped_mm``), held to float32's tolerance."""
    reason = ""
    for wide, allowed in ((torch.float64, WIDE_TOLERANCE), (torch.float32, TOLERANCE[torch.float32])):
        try:
            errors, _ = run.errors(batches, weights, trained, seed, widen=wide)
        except (EmittedCodeError, RuntimeError) as err:
            reason = reason or str(err).splitlines()[0]
            continue
        return errors, str(wide).removeprefix("torch."), allowed
    raise EmittedCodeError(f"autoshard: the proof of a 16-bit model runs it widened, and neither float64 nor "
                           f"float32 runs: {reason}")


def _batch_of(x, e: int):
    """ep rank ``e``'s input: the example's, rolled by ``e`` along its batch dim (or its last dim when
    the batch is one row); a non-tensor as it is."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or e == 0:
        return x
    dim = 0 if x.shape[0] > 1 else x.dim() - 1
    return torch.roll(x, shifts=e, dims=dim)


@dataclasses.dataclass(frozen=True)
class _GridRun:
    """One comparison of the simulated ranks with the unsharded graph (see :func:`prove_on_grid`)."""

    reference: fx.GraphModule
    code: fx.GraphModule
    plan: object
    grid: RankGrid
    output_cuts: tuple
    seq: int
    values: dict = dataclasses.field(default_factory=dict)  # ep rank 0's node values, by name, once run

    def shard(self, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        return rank_shard(self.plan, self.grid, name, full, rank)

    def errors(self, batches: list, weights: dict, trained: set, seed: int,
               widen: torch.dtype | None) -> tuple[dict, Tally]:
        """``{"output i" / "grad fqn": relative error}`` and the collectives the ranks ran; ``trained``:
        the weights whose gradients are compared; ``widen``: every float computed in that dtype."""
        grid = self.grid
        weights = {name: widened(w.detach(), widen) for name, w in weights.items()}
        ref_params = {name: PerRank([w.clone().requires_grad_(name in trained)]) for name, w in weights.items()}
        rank_params = {name: PerRank([self.shard(name, w, r).clone().requires_grad_(name in trained) for r in grid])
                       for name, w in weights.items()}
        gen = torch.Generator().manual_seed(seed)
        ref_outs, cotangents = [], []
        for e, batch in enumerate(batches):
            sim = RankSimulator(self.reference, RankGrid(()), ref_params.get, widen=widen)
            out = _flat(_unsharded(sim, [widened(x, widen) for x in batch]))
            cots = [torch.randn(o.values[0].shape, generator=gen).to(o.values[0].dtype)
                    if isinstance(o, PerRank) and o.values[0].is_floating_point() else None for o in out]
            _backward(out, [[c] for c in cots])
            ref_outs.append(out)
            cotangents.append(cots)
            if e == 0:
                self.values["reference"] = sim.values
        tally = Tally()
        per_rank = [PerRank([widened(batches[grid.coordinate(r, EP)][i], widen) for r in grid])
                    if isinstance(batches[0][i], torch.Tensor) else batches[0][i] for i in range(len(batches[0]))]
        sim = RankSimulator(self.code, grid, rank_params.get, tally=tally, widen=widen)
        got = _flat(sim.run(*per_rank))
        self.values["code"] = sim.values
        on_rank = self._on_rank(got)
        _backward(got, [[on_rank(cotangents[grid.coordinate(r, EP)][i], i, r) for r in grid] for i in range(len(got))])
        errors = {}
        for i, out in enumerate(got):
            if isinstance(out, PerRank) and isinstance(out.values[0], torch.Tensor):
                errors[f"output {i}"] = max(
                    _rel(v.detach(), on_rank(ref_outs[grid.coordinate(r, EP)][i].values[0].detach(), i, r))
                    for r, v in enumerate(out.values))
        errors |= self._gradient_errors(ref_params, rank_params, trained, weights)
        return errors, tally

    def _on_rank(self, got: list):
        """``on_rank(whole, i, rank)``: what ``rank`` holds of output ``i``: its positions of an output
        cut along the sequence, its tp chunk of one left cut over tp (loss parallelism)."""
        grid, cp, tp = self.grid, self.grid.size(CP), self.grid.size(TP)
        cuts = list(self.output_cuts) + [None] * (len(got) - len(self.output_cuts))
        positions = [local_positions(c, cp, self.seq) for c in range(cp)] if any(c is not None for c in cuts) else []
        tp_dims = [o.sharded_dim if isinstance(o, PerRank) else None for o in got]

        def on_rank(whole, i, rank):
            if whole is None:
                return None
            if cuts[i] is not None:
                whole = whole.index_select(cuts[i], positions[grid.coordinate(rank, CP)])
            return whole if tp_dims[i] is None else whole.chunk(tp, dim=tp_dims[i])[grid.coordinate(rank, TP)]

        return on_rank

    def _gradient_errors(self, ref_params, rank_params, trained, weights) -> dict:
        """Each trained weight's gradient, per tp rank (and ep rank, for an expert) summed over the
        ranks holding the same shard and divided by cp, against the reference's shard."""
        grid, cp, ep = self.grid, self.grid.size(CP), self.grid.size(EP)
        experts = self.plan.ep_weights() if self.plan is not None else frozenset()
        # a gradient zero in exact arithmetic (a key bias under softmax) is rounding noise on both sides:
        # held to a floor of a tenth of the model's typical gradient, as the tp proof does
        floor = 0.1 * _typical_rms([ref_params[name].values[0].grad for name in trained])
        errors = {}
        for name, ref_grad, grads in compared_gradients(ref_params, rank_params, trained, weights):
            scale, worst = ref_grad.double().norm().item(), 0.0
            for r in grid:
                if grid.coordinate(r, CP) or (name not in experts and grid.coordinate(r, EP)):
                    continue  # one comparison per stored shard, made on its first holder
                same = {TP: grid.coordinate(r, TP), **({EP: grid.coordinate(r, EP)} if name in experts else {})}
                parts = [grads[q] for q in grid.ranks_where(**same) if grads[q] is not None]
                mine = sum(parts) / cp if parts else torch.zeros_like(rank_params[name].values[r])
                if name in experts:
                    mine = mine * ep
                worst = max(worst, rel_error(mine, self.shard(name, ref_grad, r), scale, floor))
            errors[f"grad {name}"] = worst
        return errors


def _unsharded(sim: RankSimulator, inputs: list):
    """The reference's outputs; a reference that does not run is the model's own failure (under these
    options), not the emitted code's: said so, as the tp proof says it."""
    try:
        return sim.run(*inputs)
    except EmittedCodeError as err:
        first = str(err).splitlines()[0].replace("in the emitted code", "in the captured graph")
        raise NotImplementedError(
            f"autoshard: the model as captured does not run on these inputs and options, unsharded: {first}") from err


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


def _first_divergence(run: _GridRun, tolerance: float) -> str | None:
    """The first value the code computes, in the order it ran, whose value on some rank of ep rank 0
    differs from the reference's at that rank's positions by more than ``tolerance`` (a node kept
    whole: from its whole value): where a broken cut (a dropped gather, two stage values swapped)
    first shows. Values inside the code's submodules (blocks, pipeline stages) are named by their
    node; values cut over tp as well are skipped, and so are the rows an ep exchange delivered (other
    ranks' rows: the combine's output is compared)."""
    reference, code = run.values.get("reference", {}), run.values.get("code", {})
    nodes, grid = _computing_nodes(run.code), run.grid
    exchanged = _exchanged_names(run.code)
    ranks = grid.ranks_where(ep=0)
    cp = grid.size(CP)
    for key, got in code.items():
        name = key.rsplit(".", 1)[-1]
        want, node = reference.get(name), nodes.get(name)
        if want is None or node is None or node.op == "get_attr" or not isinstance(want.values[0], torch.Tensor):
            continue  # a parameter is never cut over the sequence, and a tp shard of one is not compared
        if name in exchanged or any(key.startswith(module + ".") for module in exchanged):
            continue
        whole = want.values[0].detach()
        if not whole.is_floating_point():
            continue
        for rank in ranks:
            value = got.values[rank]
            if not isinstance(value, torch.Tensor):
                break
            cp_rank = grid.coordinate(rank, CP)
            expected = _at_positions(whole, value.shape, cp_rank, cp, run.seq)
            if expected is None:
                break  # cut some other way (over tp): not compared
            if _rel(value.detach(), expected) > tolerance:
                where = f" on cp rank {cp_rank}" if cp > 1 else ""
                at = " at that rank's positions" if cp > 1 else ""
                return (f"{describe(node)}: its value{where} differs from the reference's{at} "
                        f"(relative error {_rel(value.detach(), expected):.1e})")
    return None


def _exchanged_names(code: fx.GraphModule) -> set[str]:
    """The names of the values between an ep dispatch and its combine, in ``code`` and the graphs it
    calls (a module called there, the experts' own unit, by its target)."""
    names: set[str] = set()
    for module in code.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        frontier = [n for n in module.graph.nodes if n.target is token_dispatch.EP_DISPATCH]
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user.name not in names and user.target is not token_dispatch.EP_COMBINE:
                    names.add(user.name)
                    if user.op == "call_module":
                        names.add(user.target)
                    frontier.append(user)
    return names


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
    if cp == 1 or whole.dim() != len(shape):
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
