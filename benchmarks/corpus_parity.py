"""The corpus trained on ranks: every case of ``tests/corpus.py`` under ``autoshard()`` on 4 gloo ranks.

The one-process proof (``benchmarks/corpus.py``) says a plan computes the model's function; this
says the sharded module built from it trains like the model on real ranks, and keeps the model's
checkpoint format. Per case, on a ``dp=2 x tp=2`` mesh:

* **3 SGD steps** (lr 0.1) of the sharded module on each rank's dp slice of the batch, next to
  the model trained on the whole batch on one device: the loss of each step and every entry of
  the state dict after the last step, within ``TOLERANCE`` (max-abs relative error per tensor);
* **a strict state-dict round trip, both ways**: the sharded module's ``state_dict()`` has the
  model's keys in the model's order; the model's own checkpoint loads into the sharded module
  with ``strict=True`` (and reads back equal through ``autoshard.full_state_dict``); the sharded
  module's gathered checkpoint loads into a fresh model with ``strict=True`` and equals the
  trained reference.

The loss is the mean squared distance of every floating output with the batch on dim 0 (logits,
hidden states, a diffusion model's prediction) to a fixed random target, summed: it reads every
output without knowing what the model is for, and its mean over the batch makes the dp ranks'
average the whole batch's loss.
Inputs with the batch on dim 0 are split over dp; others (a timestep table, a shared mask) go whole.

One 4-rank group per library (its stubs are installed only in that group's processes); each case
reports one row: ``trained`` (every check held), ``refused`` (``autoshard()`` refused the model:
the error a user gets), ``DIVERGED`` (a loss or parameter beyond the tolerance), ``CHECKPOINT``
(a round trip failed) or ``INTERNAL`` (any other error), with the measured errors.
"""

from __future__ import annotations

import datetime
import traceback

TOLERANCE = 1e-5
# parameters compare relative to their largest entry, floored: a parameter whose exact gradient is zero
# (a key norm's bias: softmax ignores a shift shared by all keys) moves only by rounding noise of
# either sign, which is no difference at the scale of the model's other parameters (tests/parity.py)
SCALE_FLOOR = 1e-2
STEPS = 3
LR = 0.1
MESH = {"dp": 2, "tp": 2}


def _batch_leaves(tree, batch: int) -> list:
    import torch
    import torch.utils._pytree as pytree

    leaves = pytree.tree_leaves(tree, is_leaf=lambda v: isinstance(v, torch.Tensor))
    if not leaves and hasattr(tree, "to_tuple"):  # a ModelOutput pytree does not know
        leaves = pytree.tree_leaves(tree.to_tuple())
    return [v for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
            and v.shape[0] == batch]


def _loss(output, batch: int, rank: int = 0, size: int = 1):
    """The mean squared distance of each batch-major floating output to a fixed random target (the
    same on every rank; each rank takes its dp slice), summed. A target, not zero: the mean square of
    a normalized output (CLIP's features) is a constant with no gradient."""
    import torch

    leaves = _batch_leaves(output, batch)
    if not leaves:
        raise ValueError("no floating output has the batch on dim 0: nothing to train on")
    total = 0.0
    for index, value in enumerate(leaves):
        shape = (value.shape[0] * size, *value.shape[1:])
        target = torch.randn(shape, generator=torch.Generator().manual_seed(index)).chunk(size)[rank]
        total = total + (value.float() - target).square().mean()
    return total


def _local(value, batch: int, rank: int, size: int):
    import torch

    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.chunk(size)[rank]
    return value


def _rel(actual, expected, scale_floor: float = 1e-30) -> float:
    from tests.parity import rel_error

    return rel_error(actual, expected, scale_floor) if expected.numel() else 0.0


def _round_trip(case, sharded, reference) -> str:
    """'' when the model's checkpoint loads strictly into the sharded module and back; else what failed."""
    import torch

    import autoshard

    want = reference.state_dict()
    keys = list(sharded.state_dict())
    if keys != list(want):
        missing, extra = sorted(set(want) - set(keys)), sorted(set(keys) - set(want))
        return f"state_dict keys differ from the model's: missing {missing[:3]}, extra {extra[:3]}" + (
            "" if missing or extra else " (order)")
    sharded.load_state_dict(want, strict=True)
    for key, value in autoshard.full_state_dict(sharded).items():
        if isinstance(value, torch.Tensor) and _rel(value, want[key]) > 0:
            return f"{key}: the model's checkpoint loaded into the sharded module reads back different"
    fresh = case.build(seed=1)
    fresh.load_state_dict(autoshard.full_state_dict(sharded), strict=True)
    for key, value in fresh.state_dict().items():
        if isinstance(value, torch.Tensor) and _rel(value, want[key]) > 0:
            return f"{key}: the sharded module's checkpoint loaded into the model reads back different"
    return ""


def train_case(case, mesh) -> dict:
    """One case on this group's ranks (a collective: every rank calls it); never raises."""
    import torch
    import torch.distributed as dist

    import autoshard
    from tests.corpus import BATCH

    row = {"mesh": "2x2", "option": "fp32", "steps": STEPS}
    rank, size = autoshard.data_parallel_rank(mesh)
    try:
        model = case.build()
        args, kwargs = case.inputs()
    except Exception as err:  # noqa: BLE001
        return row | {"status": "not built", "detail": f"{type(err).__name__}: {err}"[:300]}
    # built again, not deep-copied: a copy's functions still read the original's modules (x-transformers'
    # tied head is ``lambda t: t @ self.token_emb.emb.weight.t()``)
    reference = case.build()
    local_args = tuple(_local(a, BATCH, rank, size) for a in args)
    local_kwargs = {k: _local(v, BATCH, rank, size) for k, v in kwargs.items()}
    try:
        sharded = autoshard.autoshard(model, mesh, example_inputs=local_args, example_kwargs=local_kwargs)
    except (ValueError, NotImplementedError) as err:
        internal = type(err).__name__ == "InternalError" or not str(err).startswith("autoshard")
        return row | {"status": "INTERNAL" if internal else "refused", "detail": str(err).splitlines()[0][:300]}
    except Exception as err:  # noqa: BLE001
        return row | {"status": "INTERNAL", "detail": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
    try:
        opt_s = torch.optim.SGD([p for p in sharded.parameters() if p.requires_grad], lr=LR)
        opt_r = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
        losses = []
        for _ in range(STEPS):
            loss_s = _loss(sharded(*local_args, **local_kwargs), BATCH // size, rank, size)
            loss_s.backward()
            opt_s.step()
            opt_s.zero_grad()
            loss_r = _loss(reference(*args, **kwargs), BATCH)
            loss_r.backward()
            opt_r.step()
            opt_r.zero_grad()
            total = loss_s.detach().clone()
            dist.all_reduce(total)  # every rank of a dp group holds its slice's loss: the mean over ranks
            losses.append((total.item() / dist.get_world_size(), loss_r.item()))
        loss_error = max(abs(s - r) / max(abs(r), 1e-30) for s, r in losses)
        gathered = autoshard.full_state_dict(sharded)
        want = reference.state_dict()
        errors = {k: _rel(v, want[k], SCALE_FLOOR) for k, v in gathered.items()
                  if isinstance(v, torch.Tensor) and k in want}
        worst = max(errors.items(), key=lambda kv: kv[1], default=("", 0.0))
        row |= {"loss_error": loss_error, "param_error": worst[1], "worst_param": worst[0],
                "losses": [round(s, 7) for s, _ in losses], "reference_losses": [round(r, 7) for _, r in losses]}
        if loss_error > TOLERANCE or worst[1] > TOLERANCE:
            return row | {"status": "DIVERGED",
                          "detail": f"loss {loss_error:.1e}, {worst[0]} {worst[1]:.1e} (tolerance {TOLERANCE:.0e})"}
        failed = _round_trip(case, sharded, reference)
        return row | ({"status": "CHECKPOINT", "detail": failed} if failed else {"status": "trained", "detail": ""})
    except Exception as err:  # noqa: BLE001
        return row | {"status": "INTERNAL", "detail": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                      "trace": traceback.format_exc()[-1500:]}


def _library_group(rank: int, world_size: int, case_ids: tuple[str, ...]) -> list[dict]:
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.corpus import CASES

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    mesh = init_device_mesh("cpu", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    rows = []
    for case_id in case_ids:
        torch.manual_seed(0)
        rows.append(train_case(next(c for c in CASES if c.id == case_id), mesh) | {"case": case_id})
        dist.barrier()
    return rows


def train_cases(cases, on_row=None) -> dict[str, dict]:
    """Every case trained on 4 gloo ranks, one group per library: case id -> rank 0's row, with the
    worst error over ranks (every rank reports; a case is ``trained`` only where all say so)."""
    from autoshard.adapters.launch import spawn

    by_library: dict[str, list[str]] = {}
    for case in cases:
        by_library.setdefault(case.library, []).append(case.id)
    out = {}
    for ids in by_library.values():
        try:
            per_rank = spawn(_library_group, 4, (tuple(ids),), timeout=datetime.timedelta(seconds=120))
        except Exception as err:  # noqa: BLE001 - a group that died is a row per case, not a stopped report
            per_rank = [[{"case": i, "status": "CRASH", "detail": f"{type(err).__name__}: {err}"[:300]}
                         for i in ids]]
        for index, case_id in enumerate(ids):
            rows = [r[index] for r in per_rank]
            row = next((r for r in rows if r["status"] != "trained"), rows[0])
            out[case_id] = row
            if on_row:
                on_row(case_id, row)
    return out
