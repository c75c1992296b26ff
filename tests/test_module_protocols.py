"""The sharded module keeps the user's model's state-dict protocols: extra state
(``get_extra_state`` / ``set_extra_state``), the model's state-dict hooks, and parametrized
parameters (``torch.nn.utils.parametrize``).

In one process (the fake 4-rank group, ``fake_world``): keys and their order, strict loading,
which hooks run with what, and extra-state values (plain objects, exact there; the sharded
tensors' gathered values are not, their collectives being no-ops). One 4-rank gloo group checks
the values: round trips both ways on 2x2 and tp=4, every rank holding the first rank's extra
state, and a DCP checkpoint.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.utils.parametrizations import weight_norm

import autoshard
from autoshard.adapters import checkpoint
from autoshard.core.sharding import Role
from examples.models import Llama, LlamaConfig, MLPBlock, MLPStack
from tests.distributed import distributed_tests, remove_shared, shared_directory
from tests.parity import assert_parity, dp_slice, full, lm_loss, train_both

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
FEATURES = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(0))
W1 = ("layers.0.feed_forward.w1", "layers.1.feed_forward.w1")


class ScaledLinear(nn.Linear):
    """A linear carrying fp8-style metadata as extra state, ``{"scale": tensor, "step": int}``, and
    a non-persistent scratch buffer (state dicts leave it out). ``set_extra_state`` checks and
    converts (a tensor step becomes an int), so a loaded value that comes back converted was
    loaded by it."""

    def __init__(self, in_features: int, out_features: int, scale: float = 1.0, step: int = 0):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("amax_scratch", torch.zeros(4), persistent=False)
        self.scale = torch.tensor([scale, 2 * scale])
        self.step = step

    def get_extra_state(self):
        return {"scale": self.scale.clone(), "step": self.step}

    def set_extra_state(self, state):
        if set(state) != {"scale", "step"}:
            raise ValueError(f"ScaledLinear: extra state must hold scale and step, got {sorted(state)}")
        self.scale = state["scale"].detach().clone().float()
        self.step = int(state["step"])


class FormatTag(nn.Module):
    """A module with extra state and no parameters, which the forward never calls."""

    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def get_extra_state(self):
        return {"version": self.version}

    def set_extra_state(self, state):
        self.version = state["version"]


class TaggedLlama(Llama):
    """The example Llama with extra state on its root, on both blocks' ``w1`` and on a
    parameterless ``format`` module; heads divide by 4, so tp=4 cuts attention as tp=2 does."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__(LlamaConfig(num_layers=2, num_heads=8, num_kv_heads=4))
        for i, layer in enumerate(self.layers):
            w1 = layer.feed_forward.w1
            layer.feed_forward.w1 = ScaledLinear(w1.in_features, w1.out_features, scale=seed + 1.0, step=10 * seed + i)
            layer.feed_forward.w1.weight = w1.weight
        self.format = FormatTag(version=seed + 3)
        self.tokens_seen = 1000 * (seed + 1)

    def get_extra_state(self):
        return self.tokens_seen

    def set_extra_state(self, state):
        self.tokens_seen = int(state)


def _same(got, want) -> bool:
    """Equal extra state: tensors by value, containers entry by entry, the rest by ``==`` and type."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def _extra(state: dict) -> dict:
    return {key: value for key, value in state.items() if key.endswith("_extra_state")}


def _assert_same_extra_state(got: dict, want: dict) -> None:
    assert set(_extra(got)) == set(_extra(want)), (sorted(_extra(got)), sorted(_extra(want)))
    for key, value in _extra(want).items():
        assert _same(got[key], value), (key, got[key], value)


def _plain(state: dict) -> dict:
    """What ``autoshard.full_state_dict`` is for: every DTensor gathered, every other entry as it is."""
    return {key: full(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _shaped(state: dict) -> dict:
    """In one process (the fake group, whose collectives carry no values): each tensor as a plain one
    of its full shape, every other entry as it is: what a strict load checks. Values: the gloo checks."""
    return {key: torch.zeros(value.shape, dtype=value.dtype) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}


def _shard(model: nn.Module, mesh, inputs: torch.Tensor, **options) -> nn.Module:
    return autoshard.autoshard(model, mesh, example_inputs=(dp_slice(inputs, mesh),), **options)


# --- one process: keys, strictness, hooks ------------------------------------------------------


MESHES = {"2x2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",))}


@pytest.fixture(scope="module", params=list(MESHES))
def tagged(request, fake_world):
    shape, names = MESHES[request.param]
    model = TaggedLlama(0)
    return model, _shard(model, init_device_mesh("cpu", shape, mesh_dim_names=names), TOKENS)


def test_keys_are_the_models_in_its_order_without_non_persistent_buffers(tagged):
    model, sharded = tagged
    keys = list(sharded.state_dict())
    assert keys == list(model.state_dict())
    assert {"_extra_state", "format._extra_state", *(f"{fqn}._extra_state" for fqn in W1)} <= set(keys)
    assert not any(key.endswith(("amax_scratch", "rope_cos", "rope_sin")) for key in keys)
    assert keys == list(sharded.state_dict(keep_vars=True))


def test_extra_state_is_the_models_and_answers_on_the_sharded_module(tagged):
    model, sharded = tagged
    _assert_same_extra_state(sharded.state_dict(), model.state_dict())
    for fqn in ("", "format", *W1):
        assert _same(sharded.get_submodule(fqn).get_extra_state(), model.get_submodule(fqn).get_extra_state()), fqn
    # the parameterless module the graphs did not need is there, empty, in the model's place
    assert list(sharded._modules)[-1] == "format" and not list(sharded.format.parameters())


def test_the_models_checkpoint_loads_strictly_through_set_extra_state(tagged):
    model, sharded = tagged
    other = TaggedLlama(1).state_dict()
    other["layers.1.feed_forward.w1._extra_state"] = {"scale": torch.tensor([5, 6]), "step": torch.tensor(7)}
    try:
        sharded.load_state_dict(other, strict=True)
        got = sharded.layers[1].feed_forward.w1.get_extra_state()
        assert got["step"] == 7 and type(got["step"]) is int  # converted by ScaledLinear.set_extra_state
        assert torch.equal(got["scale"], torch.tensor([5.0, 6.0]))
        assert sharded.get_extra_state() == 2000 and sharded.format.get_extra_state() == {"version": 4}
        again = dict(sharded.state_dict())
        assert list(again) == list(model.state_dict())
        assert _same(again["layers.0.feed_forward.w1._extra_state"], other["layers.0.feed_forward.w1._extra_state"])
        # the user's model is not written: it still holds its own extra state
        _assert_same_extra_state(model.state_dict(), TaggedLlama(0).state_dict())
    finally:
        sharded.load_state_dict(model.state_dict(), strict=True)
    _assert_same_extra_state(sharded.state_dict(), model.state_dict())


def test_strict_load_names_missing_and_unexpected_extra_state(tagged):
    model, sharded = tagged
    missing = model.state_dict()
    del missing["layers.1.feed_forward.w1._extra_state"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.1\.feed_forward\.w1\._extra_state"):
        sharded.load_state_dict(missing, strict=True)
    unexpected = {**model.state_dict(), "norm._extra_state": 1}
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*norm\._extra_state"):
        sharded.load_state_dict(unexpected, strict=True)
    result = sharded.load_state_dict(unexpected, strict=False)
    assert result.unexpected_keys == ["norm._extra_state"] and result.missing_keys == []
    bad = {**model.state_dict(), "format._extra_state": {"version": 9}, "_extra_state": 5,
           "layers.0.feed_forward.w1._extra_state": {"step": 1}}
    with pytest.raises(ValueError, match="must hold scale and step"):  # the user's own check runs
        sharded.load_state_dict(bad, strict=True)
    sharded.load_state_dict(model.state_dict(), strict=True)


def test_the_sharded_checkpoint_loads_strictly_into_the_model(tagged):
    model, sharded = tagged
    fresh = TaggedLlama(2)
    fresh.load_state_dict(_shaped(sharded.state_dict()), strict=True)  # values: the gloo checks below
    _assert_same_extra_state(fresh.state_dict(), model.state_dict())


def test_two_sharded_modules_of_one_model_keep_their_own_extra_state(fake_world):
    model = TaggedLlama(0)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    first, second = _shard(model, mesh, TOKENS), _shard(model, mesh, TOKENS)
    first.load_state_dict(TaggedLlama(1).state_dict(), strict=True)
    assert first.get_extra_state() == 2000 and second.get_extra_state() == 1000 == model.get_extra_state()
    assert first.layers[0].feed_forward.w1.get_extra_state()["step"] == 10
    assert second.layers[0].feed_forward.w1.get_extra_state()["step"] == 0


class LockedLinear(ScaledLinear):
    """Extra state on a module ``copy.deepcopy`` refuses (it holds a lock)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()


def test_a_module_that_cannot_be_copied_keeps_its_extra_state_as_a_value(fake_world):
    torch.manual_seed(0)
    model = MLPStack()
    model.head = LockedLinear(32, 16, scale=3.0, step=4)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.warns(UserWarning, match="'head' .*cannot be deep-copied"):
        sharded = _shard(model, mesh, FEATURES)
    assert list(sharded.state_dict()) == list(model.state_dict())
    _assert_same_extra_state(sharded.state_dict(), model.state_dict())
    value = {"scale": torch.tensor([1.0, 1.0]), "step": 9}
    sharded.load_state_dict({**model.state_dict(), "head._extra_state": value}, strict=True)
    assert sharded.head.get_extra_state() is value and model.head.step == 4


# the model's state-dict hooks: each of torch's four kinds, on a nested module whose class has
# its own version (local_metadata), and on a module with extra state (the hook gets its copy)
CALLS: list = []


class VersionedBlock(MLPBlock):
    _version = 7


def _hooked() -> MLPStack:
    torch.manual_seed(0)
    model = MLPStack(num_blocks=2)
    model.blocks[1] = VersionedBlock(32, 64)
    model.head = ScaledLinear(32, 16, scale=2.0, step=5)
    block = model.blocks[1]

    def save_pre(module, prefix, keep_vars):
        CALLS.append(("save_pre", module, prefix))

    def save_post(module, state_dict, prefix, local_metadata):
        CALLS.append(("save_post", module, prefix, local_metadata.get("version")))
        assert tuple(state_dict[prefix + "fc1.weight"].shape) == (64, 32)  # the original layout, not [in, out]

    def load_pre(module, state_dict, prefix, local_metadata, *rest):
        CALLS.append(("load_pre", module, prefix, local_metadata.get("version")))
        legacy = state_dict.pop(prefix + "fc1.w", None)  # an old checkpoint's name
        if legacy is not None:
            state_dict[prefix + "fc1.weight"] = legacy

    def load_post(module, incompatible):
        CALLS.append(("load_post", module))
        for key in [k for k in incompatible.unexpected_keys if k.endswith("blocks.1.step_count")]:
            incompatible.unexpected_keys.remove(key)  # an entry older checkpoints have: ignored

    block.register_state_dict_pre_hook(save_pre)
    block.register_state_dict_post_hook(save_post)
    block.register_load_state_dict_pre_hook(load_pre)
    block.register_load_state_dict_post_hook(load_post)
    model.head.register_state_dict_pre_hook(save_pre)
    return model


def test_the_models_state_dict_hooks_run_with_its_prefixes_and_metadata(fake_world):
    model = _hooked()
    sharded = _shard(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), FEATURES)
    keys = list(model.state_dict())
    CALLS.clear()
    assert list(sharded.state_dict()) == keys
    saved = [c for c in CALLS if c[0].startswith("save")]
    head_copy = saved[1][1]
    assert saved == [("save_pre", model.blocks[1], "blocks.1."), ("save_pre", head_copy, "head."),
                     ("save_post", model.blocks[1], "blocks.1.", 7)]
    assert isinstance(head_copy, ScaledLinear) and head_copy is not model.head and head_copy.weight.is_meta
    assert head_copy.get_extra_state()["step"] == 5

    old = model.state_dict()
    old["blocks.1.fc1.w"] = old.pop("blocks.1.fc1.weight")
    old["blocks.1.step_count"] = torch.tensor(3)
    CALLS.clear()
    sharded.load_state_dict(old, strict=True)  # renamed by the pre-hook, the extra entry dropped by the post-hook
    assert CALLS == [("load_pre", model.blocks[1], "blocks.1.", 7), ("load_post", model.blocks[1])]
    model.load_state_dict(old, strict=True)  # as the model itself takes it

    # inside a parent module, every prefix has the parent's in front
    CALLS.clear()
    parent = nn.Module()
    parent.inner = sharded
    assert list(parent.state_dict()) == [f"inner.{key}" for key in keys]
    assert [c[2] for c in CALLS] == ["inner.blocks.1.", "inner.head.", "inner.blocks.1."]


# parametrized parameters: torch.nn.utils.parametrize (weight_norm) and the older hook-based weight_norm


def _weight_normed() -> MLPStack:
    torch.manual_seed(0)
    model = MLPStack()
    weight_norm(model.blocks[1].fc1)  # blocks.1.fc1.parametrizations.weight.original0 / original1
    torch.nn.utils.weight_norm(model.blocks[2].fc2)  # blocks.2.fc2.weight_g / weight_v (a forward pre-hook)
    return model


def test_a_parametrized_linear_is_captured():
    plan = autoshard.plan(_weight_normed(), {"dp": 2, "tp": 2}, example_inputs=(FEATURES[:2],))
    assert "blocks.1.fc1.parametrizations.weight.original1" in plan.params


def test_parametrized_parameters_keep_the_models_keys_and_are_proven(fake_world):
    model = _weight_normed()
    sharded = _shard(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), FEATURES, check=True)
    plan = sharded.autoshard_plan
    for fqn in ("blocks.1.fc1.parametrizations.weight.original0", "blocks.1.fc1.parametrizations.weight.original1",
                "blocks.2.fc2.weight_g", "blocks.2.fc2.weight_v"):
        assert plan.params[fqn].role is Role.REPLICATE, (fqn, plan.params[fqn].role)  # the matmul computed whole
    assert list(sharded.state_dict()) == list(model.state_dict())
    sharded.load_state_dict(model.state_dict(), strict=True)
    _weight_normed().load_state_dict(_shaped(sharded.state_dict()), strict=True)


# --- 4 gloo ranks: values -----------------------------------------------------------------------


def _check_round_trips(mesh) -> None:
    model = TaggedLlama(0)
    sharded = _shard(model, mesh, TOKENS, check=False)
    want = model.state_dict()
    state = sharded.state_dict()
    assert list(state) == list(want)
    plain = _plain(state)
    for key, value in want.items():
        assert _same(plain[key], value), key
    gathered = autoshard.full_state_dict(sharded)  # extra state passed through as it is
    assert list(gathered) == list(want)
    _assert_same_extra_state(gathered, want)
    fresh = TaggedLlama(2)
    fresh.load_state_dict(plain, strict=True)  # the sharded module's checkpoint into the model
    for key, value in fresh.state_dict().items():
        assert _same(value, want[key]), key

    other = TaggedLlama(1)
    sharded.load_state_dict(other.state_dict(), strict=True)  # the model's checkpoint into the sharded module
    for key, value in _plain(sharded.state_dict()).items():
        assert _same(value, other.state_dict()[key]), key
    tokens = dp_slice(TOKENS, mesh)
    logits = full(sharded(tokens))
    torch.testing.assert_close(logits, other(tokens), rtol=1e-5, atol=1e-5)
    logits.square().mean().backward()  # modules given extra state still train
    assert all(param.grad is not None for param in sharded.parameters())


def check_round_trips_on_2x2(ctx):
    _check_round_trips(ctx.mesh_2d)


def check_round_trips_on_tp4(ctx):
    _check_round_trips(ctx.mesh_tp)


def check_every_rank_holds_the_first_ranks_extra_state_and_dcp_keeps_it(ctx):
    """Ranks whose models' extra state differs (as their parameters may) all hold the first rank's;
    a DCP checkpoint saved on 2x2 brings it, and every tensor, to tp=4."""
    model = TaggedLlama(1)
    model.tokens_seen = 2000 + ctx.rank
    model.layers[1].feed_forward.w1.scale = torch.full((2,), float(ctx.rank))
    source = _shard(model, ctx.mesh_2d, TOKENS, check=False)
    assert source.get_extra_state() == 2000
    assert torch.equal(source.layers[1].feed_forward.w1.get_extra_state()["scale"], torch.zeros(2))
    assert model.tokens_seen == 2000 + ctx.rank  # the user's model is left as it was
    directory = shared_directory(ctx)
    try:
        checkpoint.save_checkpoint(directory, 1, source)
        target = _shard(TaggedLlama(0), ctx.mesh_tp, TOKENS, check=False)
        assert checkpoint.load_latest(directory, target) == 1
        want = TaggedLlama(1).state_dict()
        want["layers.1.feed_forward.w1._extra_state"]["scale"] = torch.zeros(2)
        for key, value in _plain(target.state_dict()).items():
            assert _same(value, want[key]), key
    finally:
        remove_shared(ctx, directory)


def check_parametrized_round_trip_on_2x2(ctx):
    model = _weight_normed()
    sharded = _shard(model, ctx.mesh_2d, FEATURES, check=False)
    for key, value in _plain(sharded.state_dict()).items():
        assert torch.equal(value, model.state_dict()[key]), key
    torch.manual_seed(1)
    other = MLPStack()
    weight_norm(other.blocks[1].fc1)
    torch.nn.utils.weight_norm(other.blocks[2].fc2)
    sharded.load_state_dict(other.state_dict(), strict=True)
    inputs = dp_slice(FEATURES, ctx.mesh_2d)
    torch.testing.assert_close(full(sharded(inputs)), other(inputs), rtol=1e-5, atol=1e-5)


# --- modules under two names, shared by two layers, tied across depth ----------------------------


class TwoNames(nn.Module):
    """The layer stack registered twice, as ``inner.layers`` and ``blocks``."""

    def __init__(self):
        super().__init__()
        self.inner = Llama(LlamaConfig())
        self.blocks = self.inner.layers

    def forward(self, tokens):
        return self.inner(tokens)


def _shared_feed_forward() -> Llama:
    model = Llama(LlamaConfig())
    model.layers[1].feed_forward = model.layers[0].feed_forward  # one MLP in two layers
    return model


def _tied_norm() -> Llama:
    model = Llama(LlamaConfig())
    model.layers[1].attention_norm.weight = model.layers[0].attention_norm.weight
    return model


SHARED = {"two_names": TwoNames, "shared_feed_forward": _shared_feed_forward, "tied_norm": _tied_norm}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_the_units_proven_are_the_units_fsdp_gets(name):
    """``check()`` proves the units ``autoshard()`` hands to ``fully_shard``: a block under two names is
    one unit, blocks holding one parameter between them stay in the root (FSDP manages a parameter in
    one unit). The gloo check below trains each on 2x2, where FSDP used to refuse a parameter managed
    by two groups."""
    torch.manual_seed(0)
    model = SHARED[name]()
    proof = autoshard.check(model, {"dp": 2, "tp": 2}, example_inputs=(TOKENS[:2],))  # a dp rank's batch
    assert proof.ok, proof
    assert proof.plan.units == {"two_names": ("", "inner.layers.0", "inner.layers.1")}.get(name, ("",))


def check_shared_modules_train_as_one_device(ctx):
    for name, build in SHARED.items():
        torch.manual_seed(0)
        targets = torch.randint(0, 256, TOKENS.shape, generator=torch.Generator().manual_seed(5))
        model = build()
        run = train_both(model, ctx.mesh_2d, TOKENS, targets, lm_loss)
        assert list(run.sharded.state_dict()) == list(model.state_dict()), name
        try:
            assert_parity(run, loss_tol=1e-5, param_tol=1e-5)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


CHECKS = [
    check_shared_modules_train_as_one_device,
    check_round_trips_on_2x2,
    check_round_trips_on_tp4,
    check_every_rank_holds_the_first_ranks_extra_state_and_dcp_keeps_it,
    check_parametrized_round_trip_on_2x2,
]

outcomes, test_module_protocols = distributed_tests(CHECKS)
