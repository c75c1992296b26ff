"""Proof: the emitted tp code checked against the unsharded model, in one process.

A plan is a claim about a model nobody here has seen. Before it is handed to a
user it is proven on that model: every tp rank of the emitted code runs in this
process (:mod:`autoshard.proof.simulate`), forward and backward, and every
output and every parameter gradient is compared with the unsharded captured
graph run on the same weights and inputs.

* Weights are one random full set (drawn per parameter around the model's own
  scale, so zero-initialized layers do not hide a wrong path), cut as the plan
  cuts them: transposed, fused sections permuted, the tp dim chunked.
* Inputs are fresh, not the example input: token ids are drawn over each
  embedding's whole vocabulary, including every tp rank's vocabulary slice and
  the ``padding_idx`` row; floating inputs are drawn with the example's mean
  and spread (a floating mask, two distinct values or fewer, is kept).
* Each output gets a random cotangent; every rank back-propagates its copy.
* It runs on the CPU whatever device the model is on: weights, inputs and buffers are
  copied there, and tensors the graph creates are made there.
* On a mismatch the first node whose per-rank values disagree with its chunk of
  the reference is named with its source line: forward values in graph order,
  then gradients from the output back.

What it covers: the tp ranks (and sequence parallelism), simulated. What it
does not: FSDP itself (dp sharding, its all-gathers and reduce-scatters are
torch's own) and real collectives on a wire; the multi-process tests cover
those.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from autoshard.core.errors import describe
from autoshard.core.sharding import REPLICATED, shard_on
from autoshard.passes.layout_rules import PARTIAL, PARTIAL_AVG, Strided
from autoshard.passes.mixed_dtypes import buffer_dtype_hint, widened_value_hint
from autoshard.passes.placements import multiplies
from autoshard.plans.plan import Plan
from autoshard.proof.precision import first_precision_change
from autoshard.proof.rank_grid import RankGrid
from autoshard.proof.rounding import Measure, judge
from autoshard.proof.simulate import EmittedCodeError, PerRank, RankSimulator, widened

_ATEN = torch.ops.aten
# the relative error a sharded run is held to by the dtype it computes in, on every axis (tp, cp and
# both): one table for the tp proof and the cp proof
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
_VIEW_LIKE = {_ATEN.view.default, _ATEN.reshape.default, _ATEN.flatten.using_ints, _ATEN.clone.default,
              _ATEN.contiguous.default, _ATEN._to_copy.default, _ATEN.to.dtype, _ATEN.unsqueeze.default,
              _ATEN.squeeze.dim, _ATEN.expand.default, _ATEN.slice.Tensor, _ATEN.select.int}


class ProofError(ValueError):
    """The emitted code does not compute what the model computes."""


@dataclasses.dataclass(frozen=True)
class Proof:
    """What one check measured: a :class:`~autoshard.proof.rounding.Measure` per output and gradient.

    Each measure's ``error`` is the sharded run against the unsharded one (``|a - b| / |b|``,
    max over tp ranks). Where the graph was also run in float64 (always in bf16 or fp16; in fp32
    when an error exceeds ``tolerance``), a measure is held to one device's own distance from
    float64 (:mod:`autoshard.proof.rounding`); otherwise its ``error`` is held to ``tolerance``.
    ``exact`` says which: the dtype the reference was widened to, or why it could not be."""

    tp: int
    tolerance: float
    outputs: tuple[Measure, ...]
    gradients: tuple[Measure, ...]
    first_divergence: str | None
    seconds: float
    # what the emitted code ran in one forward and backward, as plan.predicted_comm() spells it:
    # kind -> (count, ring wire bytes per rank) on the tp axis
    tp_collectives: dict = dataclasses.field(default_factory=dict, compare=False)
    plan: Plan | None = dataclasses.field(default=None, compare=False)  # the plan proven
    values: ProofValues | None = dataclasses.field(default=None, compare=False, repr=False)  # if kept
    exact: str = ""  # "float64" when measured against a float64 run; else why there is none (or "")
    # the first emitted node computing in another dtype than the model's code (autoshard.proof.precision)
    precision_change: str | None = None
    inputs: str = "fresh"  # which inputs it ran: fresh ones, or the example's (see passes/specialize)
    # on a mesh with a cp axis: the cp ranks simulated beside the tp ones, and the cp collectives they ran
    cp: int = 1
    cp_collectives: dict = dataclasses.field(default_factory=dict, compare=False)
    # on a mesh with an ep axis: the ep ranks simulated beside the tp ones, and the all-to-alls they ran
    ep: int = 1
    ep_collectives: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def ok(self) -> bool:
        return not self.failures() and self.precision_change is None

    @property
    def max_output_error(self) -> float:
        return max((m.error for m in self.outputs), default=0.0)

    @property
    def max_gradient_error(self) -> float:
        return max((m.error for m in self.gradients), default=0.0)

    @property
    def worst_factor(self) -> float | None:
        """The largest ratio of the sharded run's error to one device's (both against float64)."""
        factors = [m.factor for m in (*self.outputs, *self.gradients) if m.factor is not None]
        return max(factors, default=None)

    def error_of(self, what: str) -> float:
        """The error of one output (``"output 0"``) or gradient (``"gradient of 'fqn'"``)."""
        return next(m.error for m in (*self.outputs, *self.gradients) if m.what == what)

    def failures(self, rtol: float | None = None) -> list[Measure]:
        """The measures that fail: by the proof's own bounds, or each ``error`` against ``rtol``."""
        measures = (*self.outputs, *self.gradients)
        if rtol is not None:
            return [m for m in measures if not m.error <= rtol]
        return [m for m in measures if not m.ok]

    def __str__(self) -> str:
        verdict = "proven" if self.ok else "FAILED"
        factor = self.worst_factor
        against = (f"sharding costs at most x{factor:.2g} one device's error against float64"
                   if factor is not None else f"tolerance {self.tolerance:.0e}")
        grid = [f"{axis}={n}" for axis, n in (("ep", self.ep), ("cp", self.cp)) if n > 1]
        ranks = " x ".join([*grid, f"tp={self.tp}"])
        head = (f"autoshard proof on {ranks}: {verdict} ({len(self.outputs)} outputs max error "
                f"{self.max_output_error:.1e}, {len(self.gradients)} gradients max error "
                f"{self.max_gradient_error:.1e}, {against}, {self.seconds:.2f} s)")
        if self.inputs != "fresh":
            head += f"\n  inputs: {self.inputs}"
        if self.ok:
            return head
        worst = sorted(self.failures(), key=lambda m: -(m.judged / max(m.allowed, 1e-300)))[:5]
        lines = [head, *(f"  {m}" for m in worst)]
        if self.precision_change:
            lines.append(f"  precision: {self.precision_change}")
        if self.exact and self.exact != "float64":
            lines.append(f"  no float64 run: {self.exact}")
        if self.first_divergence:
            lines.append(f"  first divergence: {self.first_divergence}")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise ProofError(f"autoshard: the sharded code does not compute what the model does.\n{self}")


@dataclasses.dataclass(frozen=True)
class ProofValues:
    """The tensors one proof ran, kept to replay it elsewhere (a real multi-process run on the
    same weights and batch must compute what every simulated tp rank computed).

    ``args``/``kwargs`` are the fresh inputs in the model's calling form; ``weights`` the full
    random weights in the model's own layout (``model.load_state_dict(weights, strict=False)``);
    the loss of a step is ``sum(output * cotangent)`` over the outputs. Per simulated tp rank:
    ``outputs`` (per output, each rank's value; empty for a non-tensor output), ``losses``, and
    ``gradients`` (per parameter, each rank's local gradient in the stored layout: transposed,
    sections permuted, its tp chunk).
    """

    args: tuple
    kwargs: dict
    weights: dict[str, torch.Tensor]
    cotangents: tuple
    outputs: tuple[tuple[torch.Tensor, ...], ...]
    losses: tuple[float, ...]
    gradients: dict[str, tuple[torch.Tensor | None, ...]]


@dataclasses.dataclass(frozen=True)
class Subject:
    """What a proof runs: the captured graph, the emitted code and how they relate.

    ``reference`` is the graph as captured (before any pass rewrote it);
    ``planned`` the graph propagation planned on (its node names are the emitted
    graph's), ``emitted`` the flat graph with collectives, ``root`` its
    partitioned form (the code that runs). ``layouts`` and ``skip`` come from
    propagation: each planned value's layout, and the nodes whose value changes
    meaning in the rewrite (linear sites), compared only through their users.
    """

    reference: fx.GraphModule
    planned: fx.GraphModule
    emitted: fx.GraphModule
    root: fx.GraphModule
    plan: Plan
    tp: int
    layouts: dict
    skip: frozenset[str]
    vocabularies: dict[str, tuple[int, int | None]]  # placeholder name -> (rows, padding_idx)

    @classmethod
    def of(cls, reference: fx.GraphModule, planned: fx.GraphModule, emitted: fx.GraphModule, root: fx.GraphModule,
           plan: Plan, layout_plan, sites, vocab: dict) -> Subject:
        """The subject of a plan emitted from ``planned`` (a copy of the graph as propagation left it),
        its layouts (the tp size among them) and the linear sites, compared only through their users."""
        skip = frozenset(n.name for s in sites.all for n in {s.node, getattr(s, "output", s.node)})
        return cls(reference, planned, emitted, root, plan, layout_plan.tp, layout_plan.layouts, skip, vocab)


def prove(subject: Subject, model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None,
          *, seed: int = 0, rtol: float | None = None, keep_values: bool = False) -> Proof:
    """Run ``subject`` on fresh inputs and random weights; compare with the reference.
    ``rtol`` holds every error to that bound instead (no float64 run); ``keep_values`` keeps the
    tensors it ran in ``Proof.values``."""
    start = time.perf_counter()
    _refuse_meta(model)
    with torch.random.fork_rng(devices=[]):
        gen = torch.Generator().manual_seed(seed)
        inputs = fresh_inputs(subject, example_inputs, example_kwargs or {}, gen)
        weights = random_weights(subject.reference, subject.plan, model, gen)
        # the model's own (a twin captured on meta has none), on the CPU where the proof runs
        # (copies: a training-mode batch norm writes its running statistics, and the user's stay untouched)
        read = {n.target: n.meta.get("val") for n in subject.reference.graph.nodes if n.op == "get_attr"}
        buffers = {fqn: as_read(b.detach().cpu().clone(), read.get(fqn)) for fqn, b in model.named_buffers()}
        inputs_used = "fresh"
        try:
            try:
                ref = _run_reference(subject.reference, inputs, weights, buffers, gen)
            except EmittedCodeError:
                if not _branches_on_data(subject.reference):
                    raise
                # captured for the branches the example takes (passes/specialize): its own inputs do
                inputs, inputs_used = fresh_inputs(subject, example_inputs, example_kwargs or {}, gen, fresh=False), \
                    "the example's (fresh ones take another data-dependent branch)"
                ref = _run_reference(subject.reference, inputs, weights, buffers, gen)
        except EmittedCodeError as err:  # the unsharded graph itself: nothing autoshard emitted
            first = str(err).splitlines()[0].replace("in the emitted code", "in the captured graph")
            hint = _mixed_dtype_hint(err, model, subject, _compute_dtype(weights, subject.reference)) \
                if "dtype" in first else ""
            raise NotImplementedError(
                f"autoshard: the model as captured does not run on these inputs and options, unsharded: {first}{hint}"
            ) from err
        dtype = _compute_dtype(weights, subject.reference)
        tolerance = rtol if rtol is not None else TOLERANCE.get(dtype, TOLERANCE[torch.float32])
        try:
            sim = _run_emitted(subject.root, subject, inputs, weights, buffers, ref.cotangents)
        except EmittedCodeError as err:
            return Proof(subject.tp, tolerance, (Measure("emitted code", math.inf, allowed=tolerance),), (),
                         str(err).splitlines()[0], time.perf_counter() - start)
    measures = _measures(subject, sim, ref, None, dtype, tolerance)
    exact, why = None, ""
    if rtol is None and (torch.finfo(dtype).bits < 32 or not all(m.ok for m in measures)):
        exact, why = _run_exact(subject.reference, inputs, weights, buffers, ref.cotangents, dtype)
        if exact is not None:
            measures = _measures(subject, sim, ref, exact, dtype, tolerance)
        if exact is not None and not all(m.ok for m in measures):
            measures = _with_wide_sharded_run(subject, measures, inputs, weights, buffers, ref, exact, why, dtype)
    outputs = tuple(m for m in measures if m.what.startswith("output"))
    gradients = tuple(m for m in measures if not m.what.startswith("output"))
    changed = first_precision_change(subject.root, subject.planned, subject.skip, _by_name(sim.values),
                                     _plan_reduce_dtype(subject.plan))
    first = None
    if not all(m.ok for m in measures):
        first = locate(subject, inputs, weights, buffers, ref.cotangents, tolerance, dtype if exact else None) or \
            _reads_of_worst(subject, [m for m in gradients if not m.ok])
    values = _kept_values(subject, inputs, weights, ref.cotangents, sim) if keep_values else None
    return Proof(subject.tp, tolerance, outputs, gradients, first or changed, time.perf_counter() - start,
                 sim.tp_collectives, values=values, exact=why, precision_change=changed, inputs=inputs_used)


def _by_name(values: dict[str, PerRank]) -> dict[str, PerRank]:
    """Simulated values by node name (a block's nodes are kept under ``<block>.<name>``)."""
    return {key.rsplit(".", 1)[-1]: v for key, v in values.items()}


def _plan_reduce_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype the plan adds tp sums in (its mixed precision's reduce dtype), if it names one."""
    name = plan.mixed_precision.get("reduce_dtype")
    return getattr(torch, name) if name else None


def _kept_values(subject: Subject, inputs: list, weights: dict, cotangents: list, sim: _Run) -> ProofValues:
    args, kwargs = pytree.tree_unflatten(list(inputs), subject.reference._in_spec)
    outputs = tuple(tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in out.values)
                    if isinstance(out, PerRank) else () for out in sim.outputs)
    gradients = {fqn: tuple(g.detach() if g is not None else None for g in per_rank)
                 for fqn, per_rank in sim.grads.items()}
    return ProofValues(tuple(args), dict(kwargs), weights, tuple(cotangents), outputs, sim.losses, gradients)


def _measures(subject: Subject, sim: _Run, ref: _Run, exact: _Run | None, dtype: torch.dtype,
              tolerance: float) -> list[Measure]:
    """A measure per output and per parameter gradient: against ``exact`` (a float64 run of the
    same graph, see :mod:`autoshard.proof.rounding`) when given, else each error against ``tolerance``."""
    floor = 0.1 * _typical_rms(ref.grads.values())
    measures = []
    for i, (s, r) in enumerate(zip(sim.outputs, ref.outputs, strict=True)):
        if not isinstance(r, torch.Tensor):
            continue
        what, error = f"output {i}", _output_error(s, r)
        if exact is None:
            measures.append(Measure(what, error, allowed=tolerance))
            continue
        x = exact.outputs[i]
        whole = [torch.cat(s.values, dim=s.sharded_dim)] if s.sharded_dim is not None else s.values
        measures.append(judge(what, error, max(_distance(v, x) for v in whole), _distance(r, x), _size(x),
                              _size(x), dtype, tolerance))
    exact_floor = 0.1 * _typical_rms(exact.grads.values()) if exact is not None else 0.0
    for fqn in sorted(sim.grads):
        what = f"gradient of '{fqn}'"
        error = _grad_error(sim.grads[fqn], ref.grads.get(fqn), subject, fqn, floor)
        if exact is None:
            measures.append(Measure(what, error, allowed=tolerance))
            continue
        shape = subject.plan.params[fqn].shape
        x = _or_zeros(exact.grads.get(fqn), shape)
        expected = stored_shards(subject.plan.params[fqn], x, subject.tp)
        cut = subject.tp > 1 and subject.plan.params[fqn].sharded_dim("tp") is not None
        sharded = _ranks_distance([_or_zeros(g, e.shape) for g, e in zip(sim.grads[fqn], expected, strict=True)],
                                  expected, cut)
        one_device = _distance(_or_zeros(ref.grads.get(fqn), shape), x)
        noise_scale = exact_floor * math.sqrt(max(x.numel(), 1))
        measures.append(judge(what, error, sharded, one_device, _size(x), noise_scale, dtype, tolerance))
    return measures


def _or_zeros(gradient: torch.Tensor | None, shape) -> torch.Tensor:
    """A gradient autograd left as None (no path reached the parameter) is zero."""
    return gradient if gradient is not None else torch.zeros(tuple(shape), dtype=torch.float64, device="cpu")


def _with_wide_sharded_run(subject: Subject, measures: list[Measure], inputs: list, weights: dict, buffers: dict,
                           ref: _Run, exact: _Run, wide: str, dtype: torch.dtype) -> list[Measure]:
    """``measures`` with each one's ``wide_sharded``: the emitted code run in the exact run's dtype
    against that run, on the same scale as the measure (see :mod:`autoshard.proof.rounding`). When it
    fails there, nothing is added."""
    try:
        sim = _run_emitted(subject.root, subject, inputs, weights, buffers, ref.cotangents, widen=getattr(torch, wide))
    except EmittedCodeError:
        return measures
    against = _measures(subject, sim, ref, exact, dtype, 0.0)
    return [dataclasses.replace(m, wide_sharded=w.sharded, wide_dtype=getattr(torch, wide))
            for m, w in zip(measures, against, strict=True)]


def _ranks_distance(values: list[torch.Tensor], expected: list[torch.Tensor], cut: bool) -> float:
    """The tp ranks' distance from what each should hold: pieces of one tensor (``cut``) add up
    to the whole's distance; copies are as far as the farthest."""
    pieces = [_distance(v, e) for v, e in zip(values, expected, strict=True)]
    return math.sqrt(sum(p * p for p in pieces)) if cut else max(pieces)


def _distance(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """``|actual - exact|`` (Frobenius); an inf or nan both have alike counts as agreeing."""
    if actual.shape != exact.shape:
        return math.inf
    a, e = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach() for t in (actual, exact))
    a, e = a.double(), e.double()
    same = (torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))) | (torch.isnan(a) & torch.isnan(e))
    diff = torch.where(same, 0.0, a - e).norm().item()
    return diff if diff == diff else math.inf


def _size(x: torch.Tensor) -> float:
    x = x.detach().double()
    return torch.where(torch.isfinite(x), x, 0.0).norm().item()


def _run_exact(gm: fx.GraphModule, inputs: list, weights: dict, buffers: dict, cotangents: list,
               dtype: torch.dtype, retain: bool = False) -> tuple[_Run | None, str]:
    """``gm`` in float64 (float32 where float64 does not run: enough against bf16) from the same
    rounded values as a ``dtype`` run: ``(run, "float64")``, or ``(None, why there is none)``."""
    reason = ""
    for wide in (torch.float64, torch.float32):
        if torch.finfo(wide).bits <= torch.finfo(dtype).bits:
            break
        try:
            run = _run_reference(gm, [widened(v, wide) for v in inputs],
                                 {k: widened(v, wide) for k, v in weights.items()},
                                 {k: widened(v, wide) for k, v in buffers.items()}, None, retain=retain,
                                 cotangents=[widened(c, wide) for c in cotangents], widen=wide)
        except (EmittedCodeError, RuntimeError) as err:
            reason = reason or str(err).splitlines()[0]
            continue
        return run, str(wide).removeprefix("torch.")
    return None, reason or f"{dtype} is already the widest float dtype"


# --- inputs and weights ----------------------------------------------------------------------


def vocabularies(sites) -> dict[str, tuple[int, int | None]]:
    """Graph inputs that are an embedding's ids (directly or through views and casts): placeholder
    name -> (rows of the smallest such table, its padding index or None)."""
    found: dict[str, tuple[int, int | None]] = {}
    for site in sites.embeddings:
        ids = site.node.args[1]
        while isinstance(ids, fx.Node) and ids.op == "call_function" and ids.target in _VIEW_LIKE:
            ids = ids.args[0]
        if not isinstance(ids, fx.Node) or ids.op != "placeholder":
            continue
        padding = site.node.args[2] if len(site.node.args) > 2 else site.node.kwargs.get("padding_idx", -1)
        rows = site.num_embeddings
        if ids.name not in found or rows < found[ids.name][0]:
            found[ids.name] = (rows, padding if isinstance(padding, int) and padding >= 0 else None)
    return found



def fresh_inputs(subject: Subject, args: tuple, kwargs: dict, gen: torch.Generator, fresh: bool = True) -> list:
    """The flat graph inputs: new values of the example's shapes (see the module docstring), or
    (``fresh=False``) the example's own."""
    flat = list(fx_pytree.tree_flatten_spec((args, kwargs), subject.reference._in_spec))
    placeholders = [n for n in subject.reference.graph.nodes if n.op == "placeholder"]
    new = []
    for node, value in zip(placeholders, flat, strict=True):
        value = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        traced = node.meta.get("val")
        if isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor) and value.dtype != traced.dtype:
            value = value.to(traced.dtype)  # under mixed precision the root's inputs are cast, as FSDP2 casts them
        new.append(_fresh(node.name, value, subject, gen) if fresh else value)
    return new


def as_read(buffer: torch.Tensor, read) -> torch.Tensor:
    """A floating buffer in the dtype the graph reads it in (``read``: its ``get_attr``'s value;
    ``buffer_dtype`` under mixed precision). The tp and the cp proof read buffers alike."""
    if isinstance(read, torch.Tensor) and buffer.is_floating_point() and read.is_floating_point():
        return buffer.to(read.dtype)
    return buffer


def _branches_on_data(graph: fx.GraphModule) -> bool:
    """Whether the graph was captured for the data-dependent branches its example takes."""
    return any(n.target is torch.ops.aten._assert_scalar.default for n in graph.graph.nodes)


def _fresh(name: str, value, subject: Subject, gen: torch.Generator):
    """One new input value like ``value`` (see :func:`fresh_inputs`)."""
    if not isinstance(value, torch.Tensor):
        return value
    if name in subject.vocabularies:
        rows, padding = subject.vocabularies[name]
        return _token_ids(value, rows, padding, subject.tp, gen)
    if value.is_floating_point() and value.unique().numel() > 2:
        std = value.float().std().item() if value.numel() > 1 else 1.0
        new = torch.randn(value.shape, generator=gen, device="cpu") * (std or 1.0) + value.float().mean().item()
        return new.to(value.dtype)
    return value.clone()


def _token_ids(example: torch.Tensor, rows: int, padding: int | None, tp: int, gen) -> torch.Tensor:
    """Ids over ``[0, rows)``: random, with the first and last row of every tp rank's vocabulary
    slice (a slice's row 0 is where a local lookup's edge cases live) and the padding row."""
    ids = torch.randint(0, rows, example.shape, generator=gen, dtype=example.dtype, device="cpu")
    flat = ids.view(-1)
    per_rank = max(rows // tp, 1)
    must = [row for r in range(tp) for row in (r * per_rank, r * per_rank + per_rank - 1)]
    must += [padding % rows] if padding is not None else []
    positions = torch.randperm(flat.numel(), generator=gen, device="cpu")[: len(must)]
    flat[positions] = torch.tensor(must[: len(positions)], dtype=flat.dtype, device="cpu")
    return ids


def random_weights(reference: fx.GraphModule, plan: Plan, model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One random full set, in the dtype each parameter is read in: around the model's own mean
    and spread, or (a model on meta, or a constant tensor) a spread of ``1/sqrt(fan_in)``. Each
    requires grad as the model's parameter does: a frozen one's gradient is never compared."""
    read = {n.target: n.meta.get("val") for n in reference.graph.nodes if n.op == "get_attr"}
    weights = {}
    for fqn in plan.params:
        original = model.get_parameter(fqn)
        val = read.get(fqn)
        dtype = val.dtype if isinstance(val, torch.Tensor) else original.dtype
        if not original.is_floating_point():
            weights[fqn] = original.detach().cpu().clone()
            continue
        mean, std = 0.0, 0.0
        if not original.is_meta and original.numel() > 1:
            mean, std = original.detach().float().mean().item(), original.detach().float().std().item()
        if std == 0.0:
            std = (original.shape[-1] ** -0.5) if original.dim() >= 2 else 0.1
        full = torch.randn(tuple(original.shape), generator=gen, device="cpu") * std + mean
        weights[fqn] = full.to(dtype).requires_grad_(original.requires_grad)
    return weights


def stored_shards(entry, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each tp rank's local tensor of one parameter: transposed, sections permuted, chunked."""
    stored = full.t() if entry.transposed else full
    if entry.sections and tp > 1:
        stored = stored.index_select(entry.sharded_dim("tp"), entry.fused.order(tp))
    dim = entry.sharded_dim("tp") if tp > 1 else None
    if dim is None:
        return [stored.contiguous() for _ in range(tp)]
    return [c.contiguous() for c in torch.chunk(stored, tp, dim=dim)]


def _mixed_dtype_hint(err: EmittedCodeError, model: torch.nn.Module, subject: Subject, compute_dtype) -> str:
    """A buffer kept wide, else the wide value the forward makes: what the user can change."""
    return buffer_dtype_hint(model, compute_dtype) or widened_value_hint(
        err.node, compute_dtype, tuple(u for u in subject.plan.units if u))


def _compute_dtype(weights: dict[str, torch.Tensor], graph: fx.GraphModule) -> torch.dtype:
    """The narrowest float dtype the model multiplies in: its weights', or a matmul's the code casts
    down to (a float32 model whose experts run ``_grouped_mm`` in bfloat16). A sharded sum rounds
    its partial products in that dtype, so it bounds how far the sharded run may differ."""
    floating = [w.dtype for w in weights.values() if w.is_floating_point()]
    floating += [val.dtype for node in graph.graph.nodes if multiplies(node)
                 for val in (node.meta.get("val"),) if isinstance(val, torch.Tensor) and val.is_floating_point()]
    return min(floating, key=lambda d: torch.finfo(d).bits) if floating else torch.float32


def _refuse_meta(model: torch.nn.Module) -> None:
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise NotImplementedError(
            f"autoshard: the proof runs the model's buffers, and {meta[0]!r} is on the meta device; "
            f"check a model built on a real device (a small config of it is enough)"
        )


# --- runs -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    outputs: list
    grads: dict[str, object]
    cotangents: list
    values: dict[str, PerRank]
    tp_collectives: dict = dataclasses.field(default_factory=dict)
    losses: tuple[float, ...] = ()


def _leaves(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh leaves of one parameter's values; they make a gradient when the parameter does
    (a frozen one, ``requires_grad=False``, makes none, on one device as on the ranks)."""
    return [v.detach().clone().requires_grad_(v.is_floating_point() and v.requires_grad) for v in values]


def _trained(params: dict[str, PerRank]) -> dict[str, PerRank]:
    """The parameters the model trains: the ones whose gradients are compared."""
    return {fqn: p for fqn, p in params.items() if p.values[0].requires_grad}


def _run_reference(gm: fx.GraphModule, inputs: list, weights: dict, buffers: dict, gen, retain: bool = False,
                   cotangents=None, widen: torch.dtype | None = None) -> _Run:
    params = {fqn: PerRank(_leaves([w])) for fqn, w in weights.items()}
    sim = RankSimulator(gm, RankGrid(()), lambda fqn: params.get(fqn) or _replicated(buffers, fqn, 1), widen=widen)
    outputs = [o.values[0] if isinstance(o, PerRank) else o for o in _flat_outputs(sim.run(*_per_rank(inputs, 1)))]
    if cotangents is None:
        cotangents = [torch.randn(o.shape, generator=gen, device="cpu").to(o.dtype)
                      if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outputs]
    _retain(sim.values, retain)
    loss = sum(_dot(o, c) for o, c in zip(outputs, cotangents, strict=True) if c is not None and o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    grads = {fqn: p.values[0].grad for fqn, p in _trained(params).items()}
    return _Run([o.detach() if isinstance(o, torch.Tensor) else o for o in outputs], grads, cotangents, sim.values)


def _run_emitted(root: fx.GraphModule, subject: Subject, inputs: list, weights: dict, buffers: dict, cotangents,
                 retain: bool = False, widen: torch.dtype | None = None) -> _Run:
    """Every tp rank of the emitted code; with ``widen``, every float value (and every float dtype
    the code names, a sum's ``reduce_dtype`` too) in that dtype."""
    tp = subject.tp
    inputs, cotangents = [widened(v, widen) for v in inputs], [widened(c, widen) for c in cotangents]
    buffers = {k: widened(v, widen) for k, v in buffers.items()}
    params = {fqn: PerRank(_leaves(stored_shards(entry, widened(weights[fqn], widen), tp)))
              for fqn, entry in subject.plan.params.items()}
    sim = RankSimulator(root, RankGrid.of(tp=tp), lambda fqn: params.get(fqn) or _replicated(buffers, fqn, tp),
                        widen=widen)
    outputs = _flat_outputs(sim.run(*_per_rank(inputs, tp)))
    _retain(sim.values, retain)
    losses = [0] * tp  # each rank's sum(output * cotangent) over its copy or chunk of each output
    for out, cot in zip(outputs, cotangents, strict=True):
        if cot is None or not isinstance(out, PerRank):
            continue
        cuts = torch.chunk(cot, tp, dim=out.sharded_dim) if out.sharded_dim is not None else [cot] * tp
        for rank, (v, c) in enumerate(zip(out.values, cuts, strict=True)):
            if v.requires_grad:
                losses[rank] = losses[rank] + _dot(v, c)
    loss = sum(losses)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    grads = {fqn: [v.grad for v in p.values] for fqn, p in _trained(params).items()}
    return _Run(outputs, grads, cotangents, sim.values, sim.tally.result().get("tp", {}),
                tuple(float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for v in losses))


def _dot(output: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    """``sum(output * cotangent)`` in at least float32: its gradient hands ``output`` the cotangent."""
    dtype = torch.promote_types(output.dtype, torch.float32)
    return (output.to(dtype) * cotangent.to(dtype)).sum()


def _replicated(buffers: dict, fqn: str, tp: int) -> PerRank | None:
    """A buffer on every rank, each its own copy (ops may write it, as a batch norm does)."""
    return PerRank([buffers[fqn].clone() for _ in range(tp)]) if fqn in buffers else None


def _per_rank(inputs: list, tp: int) -> list[PerRank]:
    return [PerRank([v] * tp) for v in inputs]


def _flat_outputs(out) -> list:
    return pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, PerRank))


def _retain(values: dict[str, PerRank], retain: bool) -> None:
    if not retain:
        return
    for per_rank in values.values():
        for v in per_rank.values:
            if isinstance(v, torch.Tensor) and v.requires_grad and not v.is_leaf:
                v.retain_grad()


# --- comparisons ------------------------------------------------------------------------------


def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None,
              floor_rms: float = 1e-5) -> float:
    """``|actual - expected| / scale`` (Frobenius norms); ``scale`` defaults to ``|expected|`` and
    never drops below ``floor_rms`` per element: a gradient that is zero in exact arithmetic
    (a key bias under softmax) is rounding noise on both sides, not a signal."""
    if actual.shape != expected.shape:
        return float("inf")
    if not (actual.is_floating_point() or expected.is_floating_point()):
        return 0.0 if torch.equal(actual, expected) else float("inf")
    a, e = actual.detach().double(), expected.detach().double()
    same = (torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))) | (torch.isnan(a) & torch.isnan(e))
    a, e = torch.where(same, 0.0, a), torch.where(same, 0.0, e)  # the reference's own inf and nan, matched
    diff = (a - e).norm().item()
    if diff != diff:  # nan
        return float("inf")
    scale = e.norm().item() if scale is None else scale
    error = diff / max(scale, floor_rms * max(e.numel(), 1) ** 0.5)
    return error if error == error else float("inf")  # a nan scale (a nan reference) proves nothing


def _output_error(sim: PerRank, ref: torch.Tensor) -> float:
    scale = ref.detach().double().norm().item()
    if sim.sharded_dim is not None:
        return rel_error(torch.cat(sim.values, dim=sim.sharded_dim), ref, scale)
    return max(rel_error(v, ref, scale) for v in sim.values)


def _typical_rms(grads) -> float:
    """The median root-mean-square of the nonzero reference gradients: the scale below which a
    gradient is rounding noise of this model's backward."""
    rms = sorted(g.double().pow(2).mean().sqrt().item() for g in grads if g is not None and g.numel())
    rms = [r for r in rms if r > 0]
    return rms[len(rms) // 2] if rms else 1.0


def _grad_error(per_rank: list, ref: torch.Tensor | None, subject: Subject, fqn: str, floor: float) -> float:
    entry = subject.plan.params[fqn]
    if ref is None:
        return max((g.abs().max().item() if g is not None else 0.0) for g in per_rank)
    expected = stored_shards(entry, ref, subject.tp)
    scale = ref.detach().double().norm().item()  # the whole gradient's: a chunk may be ~0 alone
    return max(rel_error(g if g is not None else torch.zeros_like(e), e, scale, floor)
               for g, e in zip(per_rank, expected, strict=True))


def expected_on_ranks(layout, full: torch.Tensor, tp: int, gradient: bool = False):
    """What each rank holds of ``full`` under ``layout``; ``None`` for a partial value's forward,
    which only its sum over ranks determines. A partial sum's gradient is whole on every rank; a
    partial mean's (the total is the ranks' mean) a ``1/tp`` share."""
    if layout is None or (gradient and layout == PARTIAL):
        return [full] * tp
    if gradient and layout == PARTIAL_AVG:
        return [full / tp] * tp
    if layout in (PARTIAL, PARTIAL_AVG):
        return None
    if isinstance(layout, Strided):
        split = full.unflatten(layout.dim, [layout.split_factor, -1])
        return [c.flatten(layout.dim, layout.dim + 1) for c in torch.chunk(split, tp, dim=layout.dim + 1)]
    if isinstance(layout, int):
        return list(torch.chunk(full, tp, dim=layout))
    return None


def _value_error(layout, sim: PerRank, ref: torch.Tensor, tp: int, gradient: bool,
                 exact: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> float:
    """How far one node's per-rank values (or gradients) are from ``layout``'s view of ``ref``,
    relative; with ``exact`` (the node in a float64 run) in units of what that node may differ by
    (:func:`autoshard.proof.rounding.judge`: 1 is the bound). A rank with no gradient where the
    reference has one is as wrong as can be."""
    values = [(v.grad if gradient else v) for v in sim.values]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return 0.0 if all(v is None for v in values) and ref.abs().max().item() == 0 else float("inf")
    target = ref if exact is None else exact
    if not gradient and layout in (PARTIAL, PARTIAL_AVG):
        total = sum(v.double() for v in values)
        values, expected, cut = [total / tp if layout == PARTIAL_AVG else total], [target], False
    else:
        expected = expected_on_ranks(layout, target, tp, gradient)
        if expected is None:
            return 0.0
        cut = isinstance(layout, (int, Strided))
    if exact is None:
        return max(rel_error(v, e) for v, e in zip(values, expected, strict=True))
    sharded = _ranks_distance(values, expected, cut)
    measure = judge("", 0.0, sharded, _distance(ref, exact), _size(exact), _size(exact), dtype, 0.0)
    return measure.judged / max(measure.allowed, 1e-300) if measure.sharded is not None else 0.0


def locate(subject: Subject, inputs: list, weights: dict, buffers: dict, cotangents, tolerance: float,
           exact_dtype: torch.dtype | None = None) -> str | None:
    """The first planned node whose per-rank values disagree with the reference, with its source
    line: forward values in graph order first, then gradients from the outputs back. With
    ``exact_dtype`` (the compute dtype of a proof measured against float64) a node disagrees when
    it is farther from the planned graph run in float64 than :mod:`autoshard.proof.rounding` allows."""
    planned = _run_reference(subject.planned, inputs, weights, buffers, None, retain=True, cotangents=cotangents)
    exact = None
    if exact_dtype is not None:
        run = _run_exact(subject.planned, inputs, weights, buffers, cotangents, exact_dtype, retain=True)[0]
        exact = run.values if run is not None else None
    emitted = _run_emitted(subject.root, subject, inputs, weights, buffers, cotangents, retain=True)
    by_name = _by_name(emitted.values)
    order = [n for n in subject.emitted.graph.nodes if n.op == "call_function" and n in subject.layouts
             and n.name not in subject.skip and n.name in by_name and n.name in planned.values]
    bound = tolerance if exact is None else 1.0
    for gradient in (False, True):
        for node in (reversed(order) if gradient else order):
            ref = planned.values[node.name].values[0]
            if not isinstance(ref, torch.Tensor) or (gradient and not ref.requires_grad):
                continue
            ref = ref.grad if gradient else ref.detach()
            if ref is None:
                continue
            wide = _exact_value(exact, node.name, gradient, ref)
            err = _value_error(subject.layouts[node], by_name[node.name], ref, subject.tp, gradient, wide, exact_dtype)
            if err > bound:
                what = "gradient" if gradient else "value"
                size = f"{err:.2g} times the rounding allowed" if wide is not None else f"{err:.2e}"
                return (f"{describe(node)}: its {what} on the tp ranks differs from its layout "
                        f"{_layout_text(subject.layouts[node])} of the reference by {size}")
    return None


def _exact_value(exact: dict | None, name: str, gradient: bool, like: torch.Tensor) -> torch.Tensor | None:
    """A node's float64 value (or gradient), when the float64 run has one of ``like``'s shape."""
    if exact is None or name not in exact:
        return None
    value = exact[name].values[0]
    if not isinstance(value, torch.Tensor):
        return None
    value = value.grad if gradient else value.detach()
    return value if isinstance(value, torch.Tensor) and value.shape == like.shape else None


def _reads_of_worst(subject: Subject, failing: list[Measure]) -> str | None:
    """Every activation agrees, so the worst parameter gradient went wrong where it is read."""
    if not failing:
        return None
    worst = max(failing, key=lambda m: m.judged / max(m.allowed, 1e-300))
    fqn = worst.what.removeprefix("gradient of '").removesuffix("'")
    reads = [u for n in subject.emitted.graph.nodes if n.op == "get_attr" and n.target == fqn for u in n.users]
    where = "; ".join(describe(u) for u in reads) or "nowhere in the emitted graph"
    return f"every activation agrees, but the gradient of '{fqn}' does not; it is read by {where}"


def _layout_text(layout) -> str:
    if layout is None:
        return REPLICATED
    if isinstance(layout, int):
        return shard_on(layout)
    return str(layout)
