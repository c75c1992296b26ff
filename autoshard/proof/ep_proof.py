"""Prove code split over ep in one process: every ep (x tp) rank run side by side, each on its own
batch, against the unsharded graph run on each of those batches.

Expert parallelism's ranks are data ranks that exchange rows: each routes its own tokens. So each
simulated ep rank gets a batch of its own (the example's for ep rank 0; for rank ``e`` the example
rolled by ``e`` along its batch dim, or its last dim when the batch is one row, so the ranks route
different rows and a source mixed up in the exchange shows), and the reference graph runs once per
batch. The exchanges run as :mod:`autoshard.proof.simulate` runs them: the routing worked out from
every rank's ids, the rows moved as the all-to-all moves them, each backward the op's own.

Compared: every output of every rank with the reference's on that rank's batch; every dense
parameter's gradient summed over the ep ranks (what FSDP's average over ``dp x ep`` is, times the
ranks) with the reference's, summed over the batches; every expert weight's gradient on its rank,
times ep (its share, see :func:`autoshard.runtime.token_dispatch.ep_combine`), with its experts' rows
of the reference's. Under tp each tp rank is held to its shard, as the tp proof holds it.
"""

from __future__ import annotations

import time

import torch
import torch.fx as fx

from autoshard.core.mesh import EP, TP
from autoshard.plans.predict import Tally
from autoshard.proof.context_proof import WIDE_TOLERANCE, _backward, _flat, _rel, compared_gradients
from autoshard.proof.proof import TOLERANCE, Proof, _compute_dtype, _typical_rms, rel_error, stored_shards
from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.rounding import Measure
from autoshard.proof.simulate import EmittedCodeError, PerRank, RankSimulator, widened


def prove_experts(reference: fx.GraphModule, code: fx.GraphModule, plan, ep: int, tp: int, inputs: list,
                  weights: dict, *, seed: int = 0, rtol: float | None = None) -> Proof:
    """Run ``code`` on ``ep`` x ``tp`` simulated ranks and ``reference`` once per ep rank's batch, on flat
    ``inputs`` (ep rank 0's) and ``weights`` (FQN -> tensor); compare outputs and gradients. A model
    computing in 16 bits is also run in float64 and judged by it, as the cp proof judges."""
    start = time.perf_counter()
    dtype = _compute_dtype(weights, reference)  # a float32 model whose experts run in bf16 rounds in bf16
    tolerance = rtol if rtol is not None else TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    trained = {name for name, w in weights.items() if w.is_floating_point() and w.requires_grad}
    batches = [[_batch_of(x, e) for x in inputs] for e in range(ep)]
    errors, tally = _errors(reference, code, plan, ep, tp, batches, weights, trained, seed, None)
    wide, exact, allowed = None, "", tolerance
    if rtol is None and torch.finfo(dtype).bits < 32:
        wide, exact, allowed = _wide_errors(reference, code, plan, ep, tp, batches, weights, trained, seed)
    measures = [Measure(what, error, allowed=tolerance) if wide is None else
                Measure(what, error, sharded=wide[what], allowed=allowed) for what, error in errors.items()]
    result = tally.result()
    return Proof(tp, allowed, tuple(m for m in measures if m.what.startswith("output")),
                 tuple(m for m in measures if m.what.startswith("grad")), None, time.perf_counter() - start,
                 result.get(TP, {}), plan=plan, exact=exact, ep=ep, ep_collectives=result.get(EP, {}))


def _wide_errors(reference, code, plan, ep, tp, batches, weights, trained, seed):
    """The errors of a run with every float widened: float64 (held to float64's rounding), or float32
    where an op has no float64 kernel (``torch._grouped_mm``), held to float32's tolerance; the
    comparison of a 16-bit model is by this run, its own errors kept beside."""
    reason = ""
    for wide, allowed in ((torch.float64, WIDE_TOLERANCE), (torch.float32, TOLERANCE[torch.float32])):
        try:
            errors, _ = _errors(reference, code, plan, ep, tp, batches, weights, trained, seed, wide)
        except (EmittedCodeError, RuntimeError) as err:
            reason = reason or str(err).splitlines()[0]
            continue
        return errors, str(wide).removeprefix("torch."), allowed
    raise EmittedCodeError(f"autoshard: the ep proof of a 16-bit model runs it widened, and neither float64 nor "
                           f"float32 runs: {reason}")


def _batch_of(x, e: int):
    """ep rank ``e``'s input: the example's, rolled by ``e`` along its batch dim (or its last dim when
    the batch is one row); a non-tensor as it is."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or e == 0:
        return x
    dim = 0 if x.shape[0] > 1 else x.dim() - 1
    return torch.roll(x, shifts=e, dims=dim)


def _errors(reference, code, plan, ep, tp, batches, weights, trained, seed, widen) -> tuple[dict, Tally]:
    grid = RankGrid.of(ep=ep, tp=tp)
    experts = plan.ep_weights()
    weights = {name: widened(w.detach(), widen) for name, w in weights.items()}

    def shard(name, full, rank):
        local = stored_shards(plan.params[name], full, tp)[grid.coordinate(rank, TP)] if name in plan.params else full
        if name in experts:
            local = local.chunk(ep)[grid.coordinate(rank, EP)]
        return local

    ref_params = {name: PerRank([w.clone().requires_grad_(name in trained)]) for name, w in weights.items()}
    rank_params = {name: PerRank([shard(name, w, r).clone().requires_grad_(name in trained) for r in grid])
                   for name, w in weights.items()}
    gen = torch.Generator().manual_seed(seed)
    ref_outs, cotangents = [], []
    for batch in batches:
        out = _flat(RankSimulator(reference, 1, ref_params.get, widen=widen).run(*[widened(x, widen) for x in batch]))
        cots = [torch.randn(o.values[0].shape, generator=gen).to(o.values[0].dtype)
                if isinstance(o, PerRank) and o.values[0].is_floating_point() else None for o in out]
        _backward(out, [[c] for c in cots])
        ref_outs.append(out)
        cotangents.append(cots)
    tally = Tally()
    per_rank_inputs = [PerRank([widened(batches[grid.coordinate(r, EP)][i], widen) for r in grid])
                       if isinstance(batches[0][i], torch.Tensor) else batches[0][i] for i in range(len(batches[0]))]
    got = _flat(RankSimulator(code, tp, rank_params.get, tally=tally, widen=widen, ep=ep).run(*per_rank_inputs))
    tp_dims = [o.sharded_dim if isinstance(o, PerRank) else None for o in got]

    def on_rank(whole, i, rank):  # what rank ``rank`` holds of output ``i`` (its tp chunk, left cut: loss parallel)
        if whole is None or tp_dims[i] is None:
            return whole
        return whole.chunk(tp, dim=tp_dims[i])[grid.coordinate(rank, TP)]

    _backward(got, [[on_rank(cotangents[grid.coordinate(r, EP)][i], i, r) for r in grid] for i in range(len(got))])
    errors = {}
    for i, out in enumerate(got):
        if isinstance(out, PerRank) and isinstance(out.values[0], torch.Tensor):
            errors[f"output {i}"] = max(
                _rel(v.detach(), on_rank(ref_outs[grid.coordinate(r, EP)][i].values[0].detach(), i, r))
                for r, v in enumerate(out.values))
    floor = 0.1 * _typical_rms([ref_params[name].values[0].grad for name in trained])
    for name, ref_grad, grads in compared_gradients(ref_params, rank_params, trained, weights):
        scale, worst = ref_grad.double().norm().item(), 0.0
        for r in grid:
            if name in experts:
                mine = grads[r] * ep if grads[r] is not None else torch.zeros_like(rank_params[name].values[r])
            elif grid.coordinate(r, EP) == 0:
                parts = [grads[q] for q in grid.ranks_where(tp=grid.coordinate(r, TP)) if grads[q] is not None]
                mine = sum(parts) if parts else torch.zeros_like(rank_params[name].values[r])
            else:
                continue
            worst = max(worst, rel_error(mine, shard(name, ref_grad, r), scale, floor))
        errors[f"grad {name}"] = worst
    return errors, tally
