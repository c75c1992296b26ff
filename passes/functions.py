"""Custom ``torch.autograd.Function`` s: judged by what they compute, then inlined or kept whole.

Capture (``torch.export``) traces a Function's forward into the graph and drops
its hand-written backward; the sharded model then differentiates the traced op
sequence. Each Function the model applies is checked before planning, on the
values its first call receives (one eager forward of a twin of the model; on a
meta-device model or under mixed precision, random values of the traced
shapes), in float64 where its forward runs in float64 (else in the example's
dtype, at least float32). Two measures, one random cotangent ``v`` per
differentiable output:

* **derivative**: the backward's vector-Jacobian product against the forward's
  numerical derivative, as ``torch.autograd.gradcheck`` does but without a full
  Jacobian: for random directions ``u`` (scaled to each input's RMS),
  ``<backward(v), u>`` against ``(<v, f(x + h u)> - <v, f(x - h u)>) / 2h``,
  the median over three directions (a step across a kink of ``relu``/``round``
  at one element disturbs only its own direction). This judges the Function by
  what its forward computes, not by how it is written: a forward that cuts
  autograd's graph (an alias made with ``out.data = inp.data``, a
  ``torch.no_grad()`` section, a ``detach()``) is still correct.
* **inlining**: the backward's gradients against autograd of the *traced*
  forward: the Function alone is exported as capture exports it
  (``torch.export``, non-strict; the inputs it differentiates as parameters)
  and that graph differentiated. That is what the sharded model computes if the
  forward is inlined, so it says whether inlining is exact (1e-4).

Decisions. Inlining exact -> inlined as before (a fused activation, an in-place
op marked with ``ctx.mark_dirty``), named in the plan with both measures; a
forward whose detach the backward mirrors (``x * x.detach()``, backward ``x``)
is not its derivative but, inlined, trains exactly as its eager model does: it
is inlined and the plan says so. Inlining inexact but the backward is the
derivative -> **kept whole**: capture exports the model again with each call of
the Function as one opaque ``torch.library`` op (``autoshard_functions::<name>``)
whose forward runs the Function's forward and whose backward runs the
Function's own backward (recomputing its forward from the saved inputs, as
activation checkpointing does), so the sharded model computes exactly the
gradients the Function computes. Planning gathers an opaque op's inputs and
computes it whole on every tp rank, its neighbours cut where they can; the plan
names the Function as kept whole and its notes name the op. Neither -> refused
with both differences (a straight-through estimator: forward ``round(x)``,
backward identity).

Why kept whole rather than inlined: autograd of such a traced forward is zero
(``no_grad``/``detach``) or there is no trace at all (``.data``: torch.export
2.13 lifts the tensor the alias fills as a fake constant and fails), so inlined
the sharded model would train with other gradients, and no other forward can be
derived from a backward: the Function's own backward is the only exact one.
Why a straight-through estimator is still refused though the op could carry it:
its eager model means it, but planning does not silently keep a backward that
is not its forward's gradient (write it as ``x + (f(x) - x).detach()``, which
inlines exactly). Also refused: a kept-whole Function that modifies its input in
place, or is called with symbolic (dynamic-shape) non-tensor arguments.

What counts: inputs that are floating tensors and require grad at some call
while tracing (a mask or a buffer never does; a backward returning ``None`` for
it is right; none at all -> inlined unchecked); outputs that autograd marks
differentiable after the Function ran. A floating output the Function marks
non-differentiable is detached in the traced graph, as autograd treats it
eagerly; without that a loss reading it would reach the inputs through it. The
check runs each Function on non-leaf copies of its inputs (a ``mark_dirty``
Function may not run on a leaf), and anything its code raises there refuses it,
naming it, where it is defined and the line that applied it, never an internal
error. Limits: a forward computing in a lower precision than its float64 inputs
has finite differences too noisy for the derivative measure (it is refused
unless inlining is exact); complex inputs are not differentiated.

To see every call, capture swaps the code of ``Function.apply`` while it runs
(see :func:`_hooking_apply`): a model that bound ``apply`` once (``act =
Act.apply``) calls it through a bound method that setting another
``Function.apply`` would not reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys
import traceback
import types

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.core.errors import user_frame

TOLERANCE = 1e-4  # inlining: max |backward - autograd of traced forward| / the larger max |.|, per input
NUMERICAL_TOLERANCE = {torch.float64: 1e-3, torch.float32: 2e-2}  # backward's VJP against finite differences
STEP = {torch.float64: 1e-7, torch.float32: 1e-3}  # central-difference step, relative to each input's RMS
DIRECTIONS = 3
LIBRARY = "autoshard_functions"  # namespace of the ops that keep a Function whole


# --- seeing every call of ``Function.apply`` -----------------------------------------------------
#
# Models often bind ``apply`` once (``swiglu = SwiGLUFunction.apply`` at import, ``self.act =
# Act.apply``): such a bound method keeps the function object it was made from, so setting another
# ``Function.apply`` would not reach it. While capturing, the *code* of that function object is
# swapped for a trampoline instead (same free variable: the ``__class__`` cell of its zero-argument
# ``super()``), which every bound ``apply`` then runs, and restored after; ``_APPLY`` is a copy
# with the original code, the real apply.

_HOOK = "_autoshard_apply_hook"  # the name the trampoline reads in torch.autograd.function's globals
_FUNCTION_APPLY = torch.autograd.Function.apply.__func__
_ORIGINAL_CODE = _FUNCTION_APPLY.__code__
_APPLY = types.FunctionType(_ORIGINAL_CODE, _FUNCTION_APPLY.__globals__, _FUNCTION_APPLY.__name__,
                            _FUNCTION_APPLY.__defaults__, _FUNCTION_APPLY.__closure__)
_APPLY.__kwdefaults__ = _FUNCTION_APPLY.__kwdefaults__


class _Trampoline:
    def apply(cls, *args, **kwargs):
        __class__  # noqa: B018 (a free variable like the original's)
        return _autoshard_apply_hook(cls, *args, **kwargs)  # noqa: F821 (torch.autograd.function's global)


def _trampoline_without_cell(cls, *args, **kwargs):
    return _autoshard_apply_hook(cls, *args, **kwargs)  # noqa: F821


# the trampoline whose free variables are the original's (a code object must fit its function's closure)
_TRAMPOLINE_CODE = next((code.replace(co_name=_ORIGINAL_CODE.co_name) for code in
                         (_Trampoline.apply.__code__, _trampoline_without_cell.__code__)
                         if code.co_freevars == _ORIGINAL_CODE.co_freevars), None)


@contextlib.contextmanager
def _hooking_apply(hook):
    """Every ``Function.apply`` call in the block runs ``hook(below, cls, *args, **kwargs)``, where
    ``below`` is the apply it would run otherwise (an enclosing block's hook, or the real one)."""
    module = sys.modules[_FUNCTION_APPLY.__module__]
    previous = getattr(module, _HOOK, None)
    below = previous if previous is not None else _APPLY

    def dispatch(cls, *args, **kwargs):
        return hook(below, cls, *args, **kwargs)

    setattr(module, _HOOK, dispatch)
    if _TRAMPOLINE_CODE is not None:
        _FUNCTION_APPLY.__code__ = _TRAMPOLINE_CODE
    elif previous is None:  # another torch's apply: only calls through Function.apply are seen
        torch.autograd.Function.apply = classmethod(lambda cls, *args, **kwargs: getattr(module, _HOOK)(
            cls, *args, **kwargs))
    try:
        yield
    finally:
        if previous is None:
            if _TRAMPOLINE_CODE is not None:
                _FUNCTION_APPLY.__code__ = _ORIGINAL_CODE
            else:
                torch.autograd.Function.apply = classmethod(_FUNCTION_APPLY)
            delattr(module, _HOOK)
        else:
            setattr(module, _HOOK, previous)


@dataclasses.dataclass(frozen=True)
class CheckedFunction:
    """A Function the model applies, checked: inlined, or kept whole as one op (``whole``)."""

    name: str
    where: str
    error: float  # backward against autograd of the traced forward: max |a - b| / max(max |a|, max |b|)
    numerical: float | None = None  # backward against finite differences of the forward (None: no grad needed)
    whole: bool = False
    cls: type | None = dataclasses.field(default=None, compare=False, repr=False)
    why: str = ""  # kept whole: how inlining fails
    derivative: bool = True  # its backward agrees with finite differences of its forward

    def __str__(self) -> str:
        head = f"autograd.Function {self.name} at {self.where}"
        if self.whole:
            return (
                f"{head} kept whole (one {LIBRARY} op, computed whole on every tp rank): its backward is its "
                f"forward's derivative (finite differences agree within {self.numerical:.1e}) but {self.why}, so "
                f"the sharded model runs the Function's own forward and backward"
            )
        if self.numerical is None:
            return f"{head} inlined: no input of it requires grad"
        if self.derivative:
            return (f"{head} inlined: its backward matches autograd of its forward (max rel diff {self.error:.1e}) "
                    f"and its finite differences ({self.numerical:.1e})")
        return (f"{head} inlined: its backward matches autograd of its forward (max rel diff {self.error:.1e}), "
                f"though not its finite differences ({_number(self.numerical)}: a detach in its forward, or a "
                f"kink): it trains as its eager model does")


@dataclasses.dataclass
class _Call:
    cls: type
    args: tuple
    where: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    # per leaf of (args, kwargs): whether it required grad at any call of cls while recording
    needs_grad: list[bool] = dataclasses.field(default_factory=list)


def _is_user_function(cls) -> bool:
    return not cls.__module__.startswith("torch.")


@contextlib.contextmanager
def recording_calls(calls: list[_Call], *, clone: bool):
    """Record the first call of each user-defined Function while the model runs (and, at every
    call, which of its inputs require grad). Each call runs as it is traced: a floating output
    the Function left non-differentiable is detached (see :func:`_apply_as_traced`)."""
    seen: dict[type, _Call] = {c.cls: c for c in calls}

    def apply(below, cls, *args, **kwargs):
        if _is_user_function(cls):
            flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))]
            call = seen.get(cls)
            if call is None:
                kept = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone() if clone else _shape_of(t),
                                            (args, kwargs))
                call = _Call(cls, kept[0], user_frame(traceback.extract_stack()), kept[1], flags)
                seen[cls] = call
                calls.append(call)
            elif len(call.needs_grad) == len(flags):
                call.needs_grad = [a or b for a, b in zip(call.needs_grad, flags, strict=True)]
            else:  # called with another structure: every tensor may need a gradient
                call.needs_grad = [True] * len(call.needs_grad)
        return _apply_as_traced(below, cls, args, kwargs)

    with _hooking_apply(apply):
        yield


def _apply_as_traced(apply, cls, args, kwargs):
    """``cls.apply``, with each floating output autograd left without a gradient (marked
    non-differentiable, or made under ``no_grad``) detached when an input requires grad: eagerly
    no gradient reaches the inputs through it, and a trace must say so (it records ops only)."""
    out = apply(cls, *args, **kwargs)
    if not _is_user_function(cls) or not torch.is_grad_enabled():
        return out
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.requires_grad for t in inputs):
        return out
    return pytree.tree_map_only(
        torch.Tensor, lambda o: o.detach() if _differentiable(o) and not o.requires_grad else o,
        out)


def check_functions(calls: list[_Call], on_meta: bool, traced: list[_Call] | None = None,
                    ) -> tuple[CheckedFunction, ...]:
    """Check every recorded call; ``on_meta``: its tensors hold no values, use random ones.
    ``traced``: the same Functions recorded while tracing, whose ``needs_grad`` are used (a run
    without autograd records none)."""
    needs = {c.cls: c.needs_grad for c in traced or calls}
    checked = []
    for call in calls:
        flags = needs.get(call.cls, [])  # not traced: every tensor input is judged
        args, kwargs = call.args, call.kwargs
        if on_meta:
            gen = torch.Generator().manual_seed(0)
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t, gen=gen: _random_like(t, gen), (args, kwargs))
        # the check's own tensors, and those the Function makes on the default device, where its inputs are
        with torch.device(_device_of((args, kwargs))):
            with _refusing(call):
                measured = _measure(call.cls, args, kwargs, flags)
            function = _judge(call, measured)
            if function.whole:  # its op, registered now rather than while export traces
                with _refusing(call):
                    whole_op(call.cls, *pytree.tree_flatten((args, kwargs)))
        checked.append(function)
    return tuple(checked)


@contextlib.contextmanager
def _refusing(call: _Call):
    """Anything the Function's own code raises on the check's values refuses it, named; autoshard's
    own refusals pass through."""
    try:
        yield
    except Exception as err:
        if isinstance(err, NotImplementedError) and str(err).startswith("autoshard:"):
            raise
        raise NotImplementedError(
            f"autoshard: could not check the custom autograd.Function {call.cls.__qualname__} "
            f"({_defined_at(call.cls)}) at {call.where}: running it on the values it receives (or random ones of "
            f"their shapes) raised {type(err).__name__}: {_first_line(err)}; capture would drop its backward "
            f"unchecked. Write it without a custom backward, or as a torch.library custom op"
        ) from err


@dataclasses.dataclass
class _Measured:
    inline: float  # backward against autograd of the traced forward (inf where the trace fails)
    numerical: float | None = None  # backward against finite differences (None: no input requires grad)
    dtype: torch.dtype = torch.float64
    dirty: bool = False  # the forward returns an input it modified in place (ctx.mark_dirty)
    trace_failure: str = ""


def _judge(call: _Call, m: _Measured) -> CheckedFunction:
    name = call.cls.__qualname__
    tolerance = NUMERICAL_TOLERANCE[m.dtype]
    derivative = m.numerical is None or m.numerical <= tolerance
    if m.inline <= TOLERANCE:  # inlined, the sharded model computes what its backward computes
        return CheckedFunction(name, call.where, m.inline, m.numerical, cls=call.cls, derivative=derivative)
    traced = (f"its forward does not export alone ({m.trace_failure})" if m.trace_failure else
              f"autograd of its traced forward differs from it by max relative difference {_number(m.inline)} "
              f"(tolerance {TOLERANCE:g})")
    if not derivative:
        raise NotImplementedError(
            f"autoshard: the custom autograd.Function {name} ({_defined_at(call.cls)}) at {call.where} has a "
            f"backward that is not the gradient of its forward: its vector-Jacobian products differ from finite "
            f"differences of its forward by {_number(m.numerical)} (relative, median of {DIRECTIONS} random "
            f"directions, in {_dtype_name(m.dtype)} on the model's example inputs; tolerance {tolerance:g}), and "
            f"{traced}; inlined, the sharded model would train with other gradients than the model. Write it "
            f"without a custom backward (a straight-through estimator as x + (f(x) - x).detach()), or as a "
            f"torch.library custom op with register_autograd"
        )
    if m.dirty:
        raise NotImplementedError(
            f"autoshard: the custom autograd.Function {name} ({_defined_at(call.cls)}) at {call.where} modifies "
            f"its input in place (ctx.mark_dirty) and {traced}: inlined it would train with other gradients, and "
            f"an in-place Function is not kept whole as one op. Compute its forward with autograd (no "
            f"torch.no_grad(), .detach() or .data in it), or return a new tensor"
        )
    why = (f"its forward does not export alone ({m.trace_failure})" if m.trace_failure else
           f"autograd of its traced forward differs (max rel diff {_number(m.inline)})")
    return CheckedFunction(name, call.where, m.inline, m.numerical, whole=True, cls=call.cls, why=why)


# --- measuring one call ----------------------------------------------------------------------


def _measure(cls, args: tuple, kwargs: dict, needs_grad: list[bool]) -> _Measured:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if len(needs_grad) != len(leaves):
        needs_grad = [isinstance(t, torch.Tensor) for t in leaves]
    wanted = [i for i, t in enumerate(leaves)
              if isinstance(t, torch.Tensor) and _differentiable(t) and needs_grad[i]]
    if not wanted:  # no gradient ever flows through it: inlining is exact
        return _Measured(0.0)
    try:
        wide = [_wide(t) if isinstance(t, torch.Tensor) and _differentiable(t) else t for t in leaves]
        custom = _custom_vjp(cls, wide, spec, wanted)
        dtype = torch.float64
    except Exception:  # a forward that keeps its own dtypes: in the example's (at least float32)
        wide = [t.to(torch.promote_types(t.dtype, torch.float32))
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
        custom = _custom_vjp(cls, wide, spec, wanted)
        dtype = torch.float32
    grads, cotangents, dirty = custom
    if not any(v is not None for v in cotangents):  # no differentiable output
        grads = [torch.zeros_like(wide[i]) for i in wanted]
    inline, failure = _traced_difference(cls, wide, spec, wanted, grads, cotangents)
    numerical = _numerical_difference(cls, wide, spec, wanted, grads, cotangents, dtype)
    return _Measured(inline, numerical, dtype, dirty, failure)


def _call(cls, leaves: list, spec, apply=_APPLY):
    args, kwargs = pytree.tree_unflatten(list(leaves), spec)
    return apply(cls, *args, **kwargs)


def _tensor_outputs(out) -> list:
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


def _custom_vjp(cls, leaves: list, spec, wanted: list[int]):
    """The Function's backward for one random cotangent of each differentiable output, on
    non-leaf copies of the inputs (a Function marking its input dirty may not run on a leaf)."""
    sources = {i: leaves[i].detach().clone().requires_grad_(True) for i in wanted}
    copies = [sources[i].clone() if i in sources else (t.clone() if isinstance(t, torch.Tensor) else t)
              for i, t in enumerate(leaves)]
    with torch.enable_grad():
        outs = _tensor_outputs(_call(cls, copies, spec))
    dirty = any(o is c for o in outs for c in copies if isinstance(c, torch.Tensor))
    gen = torch.Generator().manual_seed(1)
    cotangents = [_randn(o, gen)
                  if _differentiable(o) and _in_graph(o) else None for o in outs]
    pairs = [(o, v) for o, v in zip(outs, cotangents, strict=True) if v is not None]
    if not pairs:
        return [None] * len(wanted), cotangents, dirty
    got = torch.autograd.grad([o for o, _ in pairs], [sources[i] for i in wanted], [v for _, v in pairs],
                              allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(sources[i]) for g, i in zip(got, wanted, strict=True)]
    return grads, cotangents, dirty


class _Alone(nn.Module):
    """One Function call as a module: the inputs it differentiates are parameters (so the trace
    sees them require grad), the other tensors are inputs, everything else is kept as given."""

    def __init__(self, cls, leaves: list, spec, wanted: list[int]):
        super().__init__()
        self.cls, self.spec, self.wanted = cls, spec, wanted
        self.leaves = list(leaves)
        self.sources = nn.ParameterList([nn.Parameter(leaves[i].detach().clone()) for i in wanted])
        self.others = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and i not in wanted]

    def forward(self, *others):
        leaves = list(self.leaves)
        for i, p in zip(self.wanted, self.sources, strict=True):
            leaves[i] = p.clone()  # not the leaf itself: a Function may modify its input in place
        for i, t in zip(self.others, others, strict=True):
            leaves[i] = t.clone()
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(_tensor_outputs(_apply_as_traced(_APPLY, self.cls, args, kwargs)))


def _traced_difference(cls, leaves: list, spec, wanted: list[int], grads: list, cotangents: list):
    """Max relative difference, over the inputs, between the backward's gradients and autograd
    of the forward as ``torch.export`` traces it; ``inf`` and why where it does not export."""
    module = _Alone(cls, leaves, spec, wanted)
    others = tuple(leaves[i] for i in module.others)
    try:
        with torch.random.fork_rng(devices=[]):
            exported = torch.export.export(module, others, strict=False)
    except Exception as err:
        return math.inf, f"{type(err).__name__}: {_first_sentence(err)}"
    traced = exported.module()
    sources = [p for name, p in sorted(traced.named_parameters(), key=lambda kv: _index(kv[0]))]
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        outs = traced(*others)
    pairs = [(o, v) for o, v in zip(outs, cotangents, strict=True) if v is not None and _in_graph(o)]
    # a floating output the Function left non-differentiable carries a gradient when traced: count it
    pairs += [(o, _randn(o, torch.Generator().manual_seed(2)))
              for o, v in zip(outs, cotangents, strict=True) if v is None and _in_graph(o)]
    if not pairs:
        reference = [torch.zeros_like(g) for g in grads]
    else:
        got = torch.autograd.grad([o for o, _ in pairs], sources, [v for _, v in pairs], allow_unused=True)
        reference = [g if g is not None else torch.zeros_like(s) for g, s in zip(got, sources, strict=True)]
    worst = 0.0
    for custom, want in zip(grads, reference, strict=True):
        if not want.numel():
            continue
        custom, want = _wide(custom.detach()), _wide(want.detach())
        diff = float((custom - want).abs().max())
        scale = max(float(want.abs().max()), float(custom.abs().max()))  # one of them zero: difference 1
        worst = max(worst, diff / scale if diff > 0 else 0.0)
    return worst, ""


def _index(name: str) -> int:
    return int(name.rsplit(".", 1)[-1])


def _numerical_difference(cls, leaves: list, spec, wanted: list[int], grads: list, cotangents: list,
                          dtype: torch.dtype) -> float:
    """The median over random directions ``u`` of ``|<g, u> - d/dh <v, f(x + h u)>| / scale``: the
    backward's vector-Jacobian product against central differences of the forward."""
    gen = torch.Generator().manual_seed(3)
    step = STEP[dtype]
    errors = []
    real = [(i, g) for i, g in zip(wanted, grads, strict=True) if not leaves[i].is_complex()]
    if not real:
        return 0.0
    wanted, grads = [i for i, _ in real], [g for _, g in real]
    for _ in range(DIRECTIONS):
        directions, spread = [], 0.0
        for i, g in zip(wanted, grads, strict=True):
            x = leaves[i]
            rms = x.detach().double().pow(2).mean().sqrt().item() if x.numel() else 1.0
            sigma = rms if rms > 0 else 1.0
            directions.append(_randn(x, gen, sigma))
            spread += float(g.double().pow(2).sum()) * sigma**2
        plus, minus = (_outputs_at(cls, leaves, spec, wanted, directions, s * step) for s in (1, -1))
        used = [(_wide(v), _wide(p), _wide(m)) for v, p, m in zip(cotangents, plus, minus, strict=True)
                if v is not None]
        # autograd's convention for a complex output: the gradient of Re <conj(v), f>
        change = sum(float((v.conj() * (p - m)).real.sum()) for v, p, m in used) / (2 * step)
        product = sum(float((g.double() * u.double()).sum()) for g, u in zip(grads, directions, strict=True))
        # rounding of the differences: each output element to one ulp, summed with random signs
        noise = torch.finfo(dtype).eps / step * math.sqrt(sum(float((v * p).abs().pow(2).sum()) for v, p, _ in used))
        # a direction nearly orthogonal to the gradient by chance is judged against the typical product
        scale = max(abs(product), abs(change), 1e-2 * math.sqrt(spread), noise, 1e-300)
        errors.append(abs(product - change) / scale)
    return sorted(errors)[len(errors) // 2]


def _outputs_at(cls, leaves: list, spec, wanted: list[int], directions: list, h: float) -> list:
    moved = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
    for i, u in zip(wanted, directions, strict=True):
        moved[i] = leaves[i].detach() + h * u
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        return _tensor_outputs(_call(cls, moved, spec))


# --- keeping a Function whole ------------------------------------------------------------------


@contextlib.contextmanager
def keeping_whole(functions: tuple[CheckedFunction, ...]):
    """While exporting: each call of a Function checked as ``whole`` becomes one call of its op
    (see :func:`whole_op`), so the graph holds the op and the Function's backward stays its own."""
    whole = {f.cls for f in functions if f.whole}

    def apply(below, cls, *args, **kwargs):
        if cls not in whole:
            return below(cls, *args, **kwargs)
        return _call_whole(cls, args, kwargs)

    with _hooking_apply(apply):
        yield


@dataclasses.dataclass
class _WholeOp:
    op: object  # the OpOverload
    out_spec: object  # the Function's output structure, its tensors as leaves


_OPS: dict[tuple, _WholeOp] = {}
_NAMES: set[str] = set()


def _call_whole(cls, args: tuple, kwargs: dict):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    constants = tuple((i, t) for i, t in enumerate(leaves) if i not in tensors)
    symbolic = [t for _, t in constants if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    if symbolic:
        raise NotImplementedError(
            f"autoshard: the custom autograd.Function {cls.__qualname__} ({_defined_at(cls)}) is kept whole as one "
            f"op (its forward cuts autograd's graph), but is called with symbolic arguments ({symbolic[0]}): give "
            f"the sizes it takes as static values, or compute its forward with autograd"
        )
    entry = whole_op(cls, leaves, spec)
    out = entry.op(*[leaves[i] for i in tensors])
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return pytree.tree_unflatten(outs, entry.out_spec)


def whole_op(cls, leaves: list, spec) -> _WholeOp:
    """The op that runs ``cls`` on tensors at these places of ``leaves`` (the other leaves fixed):
    registered once per Function and structure, in this process, under ``autoshard_functions``."""
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    constants = tuple((i, t) for i, t in enumerate(leaves) if i not in tensors)
    try:
        key = (cls, spec, constants)
        hash(key)
    except TypeError:
        key = (cls, spec, tuple((i, id(t)) for i, t in constants))
    if key in _OPS:
        return _OPS[key]
    template = [None if isinstance(t, torch.Tensor) else t for t in leaves]

    def rebuild(values):
        filled = list(template)
        for i, t in zip(tensors, values, strict=True):
            filled[i] = t
        return filled

    probe = _probe(cls, leaves, spec)
    out_leaves, out_spec = pytree.tree_flatten(probe)
    if any(not isinstance(o, torch.Tensor) and o is not None for o in out_leaves):
        raise NotImplementedError(
            f"autoshard: the custom autograd.Function {cls.__qualname__} ({_defined_at(cls)}) is kept whole as one "
            f"op (its forward cuts autograd's graph), but returns values that are not tensors"
        )
    out_leaves = [o for o in out_leaves if o is not None]
    _, out_spec = pytree.tree_flatten(pytree.tree_unflatten(
        [object() if o is not None else None for o in pytree.tree_leaves(probe)], out_spec))
    count = len(out_leaves)
    name = _unique_name(_op_base(cls))
    inputs = ", ".join(f"Tensor t{k}" for k in range(len(tensors)))
    returns = "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"

    def forward(*values):
        with torch.no_grad():
            outs = _tensor_outputs(_call(cls, rebuild(values), spec))
        return _as_returned(_fresh(outs, values))

    def fake(*values):
        outs = _tensor_outputs(_call(cls, rebuild(values), spec))
        return _as_returned([o.clone() for o in outs])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        needs = [k for k, t in enumerate(saved) if ctx.needs_input_grad[k] and _differentiable(t)]
        result = [None] * len(saved)
        if not needs:
            return tuple(result)
        with torch.enable_grad():
            sources = {k: saved[k].detach().requires_grad_(True) for k in needs}
            values = [sources[k].clone() if k in sources else t.detach() for k, t in enumerate(saved)]
            outs = _tensor_outputs(_call(cls, rebuild(values), spec))
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and _in_graph(o)]
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], [sources[k] for k in needs],
                                          [g for _, g in pairs], allow_unused=True)
                for k, g in zip(needs, got, strict=True):
                    result[k] = g
        return tuple(result)

    op = torch.library.custom_op(f"{LIBRARY}::{name}", forward, mutates_args=(),
                                 schema=f"({inputs}) -> {returns}")
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
    entry = _WholeOp(getattr(getattr(torch.ops, LIBRARY), name).default, out_spec)
    _OPS[key] = entry
    return entry


def _probe(cls, leaves: list, spec):
    """The Function's outputs on these (fake) inputs, without recording anything in a trace."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), torch.no_grad():
        return _call(cls, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def _fresh(outs: list, inputs) -> list:
    """Outputs that share no storage with the inputs or each other (an op may return no alias)."""
    taken = [_storage(t) for t in inputs if isinstance(t, torch.Tensor)]
    fresh = []
    for o in outs:
        key = _storage(o)
        fresh.append(o.clone() if key in taken else o)
        taken.append(_storage(fresh[-1]))
    return fresh


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return id(t)


def _as_returned(outs: list):
    return outs[0] if len(outs) == 1 else tuple(outs)


def _op_base(cls) -> str:
    return re.sub(r"\W", "_", getattr(cls, "__name__", "Function")) or "Function"


def _unique_name(base: str) -> str:
    name, k = base, 1
    while name in _NAMES or hasattr(getattr(torch.ops, LIBRARY), name):
        name, k = f"{base}_{k}", k + 1
    _NAMES.add(name)
    return name


# --- helpers -----------------------------------------------------------------------------------


def _defined_at(cls) -> str:
    try:
        path, line = inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is None:
            return "defined at ?"
        path, line = code.co_filename, code.co_firstlineno
    return f"defined at {os.path.basename(path or '?')}:{line}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _first_sentence(err: BaseException) -> str:
    line = _first_line(err)
    return line.split(". ")[0].rstrip(".")[:160]


def _number(x: float) -> str:
    return "inf" if x == math.inf else f"{x:.3g}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _in_graph(t: torch.Tensor) -> bool:
    """Whether a gradient can flow back from ``t`` (a view made under ``no_grad`` of a tensor that
    requires grad requires grad too, but leads nowhere)."""
    return t.requires_grad and t.grad_fn is not None


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _randn(like: torch.Tensor, gen, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times ``scale``) of ``like``'s shape, drawn on the CPU by ``gen``."""
    values = torch.randn(like.shape, generator=gen, dtype=torch.float64, device="cpu") * scale
    return values.to(like.device, like.dtype)


def _device_of(tree) -> torch.device:
    """Where a call's tensors are (its Function may make tensors on the default device)."""
    tensors = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s (concrete) shape and dtype: all a traced call keeps (made outside
    the trace, which would otherwise record it)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    shape = [int(s) if not isinstance(s, torch.SymInt) else int(s.node.hint or 2) for s in t.shape]
    with disable_proxy_modes_tracing():
        return torch.empty(shape, dtype=t.dtype, device="meta")


def _random_like(t: torch.Tensor, gen) -> torch.Tensor:
    """Random values of ``t``'s shape, on the CPU (a meta model's Functions are checked there);
    floating ones in at least float32 (the check widens them to float64 where the forward allows)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, generator=gen, device="cpu", dtype=torch.promote_types(t.dtype, torch.float32))
    return torch.zeros(t.shape, dtype=t.dtype, device="cpu")
