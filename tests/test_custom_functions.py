"""Custom ``torch.autograd.Function`` s inside a model: judged by what they compute.

Each kind is applied inside a small MLP (two ``nn.Linear`` in a ``ModuleList``), planned and proven
on dp=2 x tp=2 in one process, and its sharded gradients are compared with the eager model's, whose
gradients the Function's own backward computes: the proof alone compares the sharded code with the
captured graph, so a captured graph that differentiated the Function otherwise would still pass it.

* inlined (its backward is autograd of its traced forward): an in-place Function (``mark_dirty``),
  one applied to a parameter (a leaf), one returning a tuple with an integer output and a floating
  output marked non-differentiable (whose gradient the trace must cut), ``None`` gradients and a
  ``once_differentiable`` backward;
* kept whole (its backward is its forward's numerical derivative, autograd of its trace is not):
  an alias made with ``out.data = inp.data`` (its forward does not even export), a forward under
  ``torch.no_grad()``, one through ``detach()``, one applied to a parameter;
* refused: a straight-through estimator, an in-place Function whose forward cuts autograd, and a
  Function the check cannot run.

Every kind that is planned also trains on 4 gloo ranks (dp=2 x tp=2, FSDP2 and DTensor parameters)
next to its eager model, in one process group for the file: the op that keeps a Function whole
runs in the real runtime too.

Also: the public error types are importable from ``autoshard``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.autograd.function import once_differentiable

import autoshard
from autoshard.passes import functions
from autoshard.proof.proof import stored_shards
from tests.distributed import distributed_tests
from tests.parity import assert_parity, mse_loss, train_both

MESH = {"dp": 2, "tp": 2}
DIM, HIDDEN = 16, 32
X = torch.randn(8, DIM, generator=torch.Generator().manual_seed(0))


# --- the Functions ------------------------------------------------------------------------------


class Alias(torch.autograd.Function):
    """An alias that drops its input's view base to save memory (as found in public code)."""

    @staticmethod
    def forward(ctx, inp):
        out = torch.empty(1, dtype=inp.dtype, device=inp.device)
        out.data = inp.data
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class NoGradDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class DetachedSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.detach() ** 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class DetachedProduct(torch.autograd.Function):
    """``x * x.detach()`` with the backward autograd gives it (``x``), not the derivative ``2x``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.detach()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x


class InPlaceDouble(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class InPlaceNoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        with torch.no_grad():
            x.mul_(2)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class ScaledWeight(torch.autograd.Function):
    """Applied to a parameter: its input is a leaf."""

    @staticmethod
    def forward(ctx, w, scale: float):
        ctx.scale = scale
        return w * scale

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class NoGradScaledWeight(ScaledWeight):
    @staticmethod
    def forward(ctx, w, scale: float):
        ctx.scale = scale
        with torch.no_grad():
            return w * scale


class GainWithStats(torch.autograd.Function):
    """A tuple out: the scaled input, an integer argmax and a float statistic marked
    non-differentiable; ``None`` gradients for the int argument, a once-differentiable backward."""

    @staticmethod
    def forward(ctx, x, gain, times: int):
        ctx.save_for_backward(x, gain)
        ctx.times = times
        top = x.argmax(-1)
        stat = x.pow(2).mean(-1, keepdim=True)
        ctx.mark_non_differentiable(top, stat)
        return x * gain * times, top, stat

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_top, grad_stat):
        x, gain = ctx.saved_tensors
        return grad * gain * ctx.times, (grad * x * ctx.times).sum(0), None


class Float32Only(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        assert x.dtype == torch.float32, "a float32 kernel"
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: forward round(x), backward identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


# --- the models ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """Two linears in a ModuleList; ``between`` applies the Function to the first one's output."""

    def __init__(self, between):
        super().__init__()
        self.between = between
        self.layers = nn.ModuleList([nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.between(self.layers[0](x))))


class WeightMLP(nn.Module):
    """A middle weight read through a Function (a leaf requiring grad is its input)."""

    def __init__(self, function):
        super().__init__()
        self.function = function
        self.layers = nn.ModuleList([nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)])
        self.mid = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * HIDDEN**-0.5)

    def forward(self, x):
        h = torch.relu(self.layers[0](x))
        return self.layers[1](torch.relu(F.linear(h, self.function.apply(self.mid, 0.5))))


class StatsMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)])
        self.gain = nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, x):
        y, top, stat = GainWithStats.apply(self.layers[0](x), self.gain, 2)
        # the statistic reaches the loss: eagerly no gradient flows back through it
        return self.layers[1](torch.relu(y)) + stat + 1e-3 * top.unsqueeze(-1).to(y.dtype)


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "alias": lambda: MLP(Alias.apply),
        "no_grad": lambda: MLP(NoGradDouble.apply),
        "detach": lambda: MLP(DetachedSquare.apply),
        "mark_dirty": lambda: MLP(InPlaceDouble.apply),
        "detach_trick": lambda: MLP(DetachedProduct.apply),
        "leaf": lambda: WeightMLP(ScaledWeight),
        "leaf_no_grad": lambda: WeightMLP(NoGradScaledWeight),
        "tuple_outputs": StatsMLP,
    }[kind]()


INLINED = {"mark_dirty": "InPlaceDouble", "leaf": "ScaledWeight", "tuple_outputs": "GainWithStats",
           "detach_trick": "DetachedProduct"}
KEPT_WHOLE = {"alias": "Alias", "no_grad": "NoGradDouble", "detach": "DetachedSquare",
              "leaf_no_grad": "NoGradScaledWeight"}


def _apply_restored() -> bool:
    """``Function.apply`` runs its own code again (capture swaps it to see every call)."""
    return torch.autograd.Function.apply.__func__.__code__ is functions._ORIGINAL_CODE and \
        not hasattr(torch.autograd.function, functions._HOOK)


def _assert_gradients_are_the_models(model: nn.Module, report) -> None:
    """Every tp rank's gradients in the proof equal the eager model's (whose Functions run their
    own backward) on the proof's weights, inputs and cotangents."""
    values = report.values
    eager = copy.deepcopy(model)
    eager.load_state_dict(values.weights, strict=False)
    outputs = pytree.tree_leaves(eager(*values.args, **values.kwargs))
    loss = sum((o * c).sum() for o, c in zip(outputs, values.cotangents, strict=True) if c is not None)
    loss.backward()
    tp = report.proof.tp
    for fqn, param in eager.named_parameters():
        expected = stored_shards(report.plan.params[fqn], param.grad, tp)
        for rank in range(tp):
            got, want = values.gradients[fqn][rank], expected[rank]
            got = torch.zeros_like(want) if got is None else got  # no gradient reached it
            error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            assert error <= 1e-5, f"{fqn} on tp rank {rank}: {error:.2e} from the eager model's gradient"


@pytest.mark.parametrize("kind", [*INLINED, *KEPT_WHOLE])
def test_function_is_proven_with_the_gradients_its_backward_computes(kind):
    model = _build(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    proof = autoshard.check(model, MESH, example_inputs=(X,))
    assert proof.ok, str(proof)
    (line,) = proof.plan.functions
    if kind in INLINED:
        assert f"autograd.Function {INLINED[kind]} at test_custom_functions.py:" in line and " inlined: " in line
        assert ("though not its finite differences" in line) == (kind == "detach_trick"), line
    else:
        assert f"autograd.Function {KEPT_WHOLE[kind]} at test_custom_functions.py:" in line, line
        assert " kept whole " in line and "its backward is its forward's derivative" in line, line
    report = autoshard.testing.check(model, MESH, example_inputs=(X,), keep_values=True)
    report.assert_close()
    _assert_gradients_are_the_models(model, report)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _apply_restored()


def test_the_alias_is_kept_whole_as_one_op_computed_on_every_tp_rank():
    """The alias cannot be inlined (export lifts the tensor its forward fills as a fake constant):
    the graph holds one ``autoshard_functions`` op, whose inputs are gathered whole."""
    model = _build("alias")
    plan = autoshard.plan(model, MESH, example_inputs=(X,))
    (line,) = plan.functions
    assert "does not export alone" in line, line
    assert "(one autoshard_functions op, computed whole on every tp rank)" in line
    assert "node 'alias" in str(plan) and "gathered whole" in str(plan), str(plan)
    sharded_like = autoshard.testing.check(model, MESH, example_inputs=(X,))
    assert "torch.ops.autoshard_functions.Alias" in "\n".join(c.code for c in sharded_like.code)


def test_a_kept_whole_function_plans_on_meta_and_with_dynamic_shapes():
    """On the meta device the check runs on random values of the traced shapes; the op's fake
    kernel runs the Function's forward on fake (and symbolic) tensors."""
    on_cpu = _build("no_grad")
    with torch.device("meta"):
        on_meta = MLP(NoGradDouble.apply)
    roles = {fqn: p.role for fqn, p in autoshard.plan(on_cpu, MESH, example_inputs=(X,)).params.items()}
    plan = autoshard.plan(on_meta, MESH, example_inputs=(X,))
    assert {fqn: p.role for fqn, p in plan.params.items()} == roles
    assert " kept whole " in plan.functions[0]
    batch = ({0: torch.export.Dim("batch", min=2, max=64)},)
    dynamic = autoshard.check(on_cpu, MESH, example_inputs=(X,), dynamic_shapes=batch)
    assert dynamic.ok, str(dynamic)
    assert " kept whole " in dynamic.plan.functions[0]


def test_a_straight_through_estimator_is_refused_with_the_difference():
    model = MLP(RoundSTE.apply)
    with pytest.raises(NotImplementedError) as err:
        autoshard.check(model, MESH, example_inputs=(X,))
    message = str(err.value)
    assert "custom autograd.Function RoundSTE (defined at test_custom_functions.py:" in message, message
    assert "has a backward that is not the gradient of its forward" in message
    assert "differ from finite differences of its forward by 1 " in message  # round's derivative is 0
    assert "max relative difference 1 " in message  # autograd of round is 0 too
    assert "`return self.layers[1](torch.relu(self.between(self.layers[0](x))))`" in message
    assert _apply_restored()


def test_an_in_place_function_whose_forward_cuts_autograd_is_refused():
    with pytest.raises(NotImplementedError, match=r"InPlaceNoGrad .* modifies its input in place \(ctx.mark_dirty\)"):
        autoshard.plan(MLP(InPlaceNoGrad.apply), MESH, example_inputs=(X,))


def test_a_function_the_check_cannot_run_is_refused_by_name(monkeypatch):
    """Whatever the check meets while running a Function becomes a refusal naming it and its line,
    never an internal error."""

    def fails(*args, **kwargs):
        raise RuntimeError("expected a contiguous tensor")

    monkeypatch.setattr(functions, "_custom_vjp", fails)
    with pytest.raises(NotImplementedError) as err:
        autoshard.plan(_build("no_grad"), MESH, example_inputs=(X,))
    message = str(err.value)
    assert message.startswith("autoshard: could not check the custom autograd.Function NoGradDouble (defined at "
                              "test_custom_functions.py:"), message
    assert "raised RuntimeError: expected a contiguous tensor" in message
    assert not isinstance(err.value, autoshard.InternalError)


def test_the_check_measures_each_kind_as_documented():
    """The measures behind the decisions, on one Function call each (float64)."""
    x = torch.randn(4, 8, dtype=torch.float64)
    identity = functions._measure(Alias, (x,), {}, [True])
    assert identity.inline == float("inf") and "fake tensor" in identity.trace_failure and identity.numerical < 1e-8
    cut = functions._measure(NoGradDouble, (x,), {}, [True])
    assert cut.inline == 1.0 and cut.numerical < 1e-8 and not cut.dirty
    dirty = functions._measure(InPlaceNoGrad, (x,), {}, [True])
    assert dirty.dirty and dirty.numerical < 1e-8
    in_place = functions._measure(InPlaceDouble, (x,), {}, [True])
    assert in_place.inline == 0.0 and in_place.numerical < 1e-8 and in_place.dirty
    trick = functions._measure(DetachedProduct, (x,), {}, [True])
    assert trick.inline == 0.0 and trick.numerical > 0.1  # inlined exactly, though not the derivative
    ste = functions._measure(RoundSTE, (x,), {}, [True])
    assert ste.inline == 1.0 and ste.numerical == pytest.approx(1.0)
    # no input that requires grad: no gradient ever flows through it
    quiet = functions._measure(RoundSTE, (x,), {}, [False])
    assert quiet.inline == 0.0 and quiet.numerical is None
    # in the example's dtype where the forward refuses float64
    assert functions._measure(Float32Only, (x.float(),), {}, [True]).dtype == torch.float32


# --- the public error types ---------------------------------------------------------------------


def test_the_error_types_a_user_can_meet_are_exported():
    from autoshard.adapters.launch import PeerFailed, RankFailed
    from autoshard.core.errors import InternalError
    from autoshard.passes.capture import CaptureError
    from autoshard.proof.proof import ProofError
    from autoshard.proof.simulate import EmittedCodeError

    for cls in (CaptureError, EmittedCodeError, InternalError, PeerFailed, ProofError, RankFailed):
        assert getattr(autoshard, cls.__name__) is cls
        assert cls.__name__ in autoshard.__all__
        assert issubclass(cls, Exception)


class BranchAfterFunction(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x):
        h = self.function.apply(self.layers[0](x))
        if h.sum() > 0:  # on meta there is no value to take the branch by
            return self.layers[1](h)
        return h


@pytest.mark.parametrize("function", [NoGradDouble, InPlaceDouble], ids=["kept_whole", "inlined"])
def test_a_capture_failure_after_a_function_is_the_exported_class(function):
    """Export fails after the Function was traced: it is checked (kept whole: traced again), and
    the capture failure reaches the user as ``autoshard.CaptureError``."""
    with torch.device("meta"):
        model = BranchAfterFunction(function)
    with pytest.raises(autoshard.CaptureError, match=r"could not capture BranchAfterFunction .*h.sum\(\) > 0"):
        autoshard.plan(model, MESH, example_inputs=(X,))
    assert _apply_restored()


# --- trained on 4 gloo ranks --------------------------------------------------------------------


def _make_training_check(kind: str):
    def check(ctx):
        inputs = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
        targets = torch.randn(8, DIM, generator=torch.Generator().manual_seed(2))
        run = train_both(_build(kind), ctx.mesh_2d, inputs, targets, mse_loss, steps=3)
        assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
        whole = " kept whole " in run.sharded.autoshard_plan.functions[0]
        assert whole == (kind in KEPT_WHOLE), run.sharded.autoshard_plan.functions

    check.__name__ = check.__qualname__ = f"check_{kind}_trains_like_its_eager_model"
    return check


CHECKS = [_make_training_check(kind) for kind in (*INLINED, *KEPT_WHOLE)]

outcomes, test_check = distributed_tests(CHECKS)
