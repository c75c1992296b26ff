"""``autoshard()``, ``plan()`` and ``check()``: the public door.

Each reads the user's options and hands them to the driver (:mod:`autoshard.driver.entry_points`),
which decides what the mesh's axes need: the door names no axis. ``autoshard()`` runs

capture -> discover -> normalize -> propagate -> alternatives -> placements (the plan) -> layouts
-> transpose -> partition -> [ranks agree] -> [proof] -> materialize -> activation checkpointing -> verify
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.core.options import SHARDING_KEYWORDS, Options
from autoshard.driver.entry_points import AUTO_CHECK_MAX_ELEMENTS, plan_model, prove_model, shard_model  # noqa: F401
from autoshard.plans.plan import Plan
from autoshard.proof.proof import Proof


def check(
    model: nn.Module,
    mesh: DeviceMesh | Mapping[str, int],
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    plan: Plan | Mapping | None = None,
    seed: int = 0,
    rtol: float | None = None,
    options: Options | None = None,
    **keywords,
) -> Proof:
    """Prove the plan for ``model`` on ``mesh`` in this process, without a process group.

    Every tp rank of the emitted code runs here, forward and backward, on fresh inputs of
    the example's shapes (token ids over the whole vocabulary) and one random full set of
    weights cut as the plan cuts them; collectives are simulated across the ranks' values.
    Every output and every parameter gradient is compared with the unsharded captured graph
    on the same weights and inputs. FSDP over the dp axes is torch's own and not simulated.

    Args:
        model: the single-device model, only read: its weights set the spread of the random ones,
            its buffers are used as they are (copied).
        mesh: a ``DeviceMesh`` or a dict of axis sizes (``{"dp": 2, "tp": 4}``).
        example_inputs: one rank's batch; only shapes, dtypes and masks are taken from it.
        plan: a saved plan to prove instead of planning.
        seed: seeds the weights, inputs and output gradients.
        rtol: the relative error allowed (default by compute dtype: 1e-4 fp32, 3e-2 bf16).
        options: an :class:`~autoshard.core.options.Options`; each of its options may also be given
            as a keyword (``sequence_parallel=True``), applied over it. ``mp_policy`` proves the code
            as it runs in ``param_dtype``. On a mesh with a ``pp`` axis the stages, called one after
            another on one microbatch, are proven against the unsharded graph.

    Returns:
        a :class:`~autoshard.proof.proof.Proof`: ``ok``, the error of every output and gradient, the
        first diverging node when it failed; ``raise_if_failed()`` raises with all of it.

    Example::

        proof = autoshard.check(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        proof.raise_if_failed()
    """
    chosen = Options.of(options, caller="check", refused=SHARDING_KEYWORDS, **keywords)
    return prove_model(model, mesh, example_inputs, example_kwargs, plan, chosen, seed=seed, rtol=rtol)


def plan(
    model: nn.Module,
    mesh: DeviceMesh | Mapping[str, int],
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    options: Options | None = None,
    **keywords,
) -> Plan:
    """Plan how ``model`` is sharded over ``mesh`` without touching any tensor.

    One process, no process group: the model is captured on its example inputs
    and planned; nothing is sharded or run.

    Args:
        model: the single-device model (left untouched).
        mesh: a ``DeviceMesh``, or a mapping of axis sizes (``{"dp": 2, "tp": 4}``)
            to plan for a mesh that does not exist in this process.

    Keyword Args:
        example_inputs, example_kwargs: as :func:`autoshard`'s.
        options: an :class:`~autoshard.core.options.Options`; each of its planning options may also
            be given as a keyword (``sequence_parallel=True``, ``microbatches=4``), applied over it.

    Returns:
        The :class:`~autoshard.plans.plan.Plan` :func:`autoshard` would apply.

    Example::

        plan = autoshard.plan(model, {"dp": 2, "tp": 4}, example_inputs=(tokens,))
        print(plan)
    """
    chosen = Options.of(options, caller="plan", refused=SHARDING_KEYWORDS, **keywords)
    return plan_model(model, mesh, example_inputs, example_kwargs, chosen)


def autoshard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    example_inputs: tuple,
    example_kwargs: dict | None = None,
    plan: Plan | Mapping | None = None,
    options: Options | None = None,
    **keywords,
):
    """Shard ``model`` over ``mesh`` (axes ``dp`` and/or ``tp``) and return a GraphModule.

    The result, called on a rank's local batch, returns what ``model`` returns for it, as full
    (tp-replicated) tensors; its ``parameters()`` are the sharded DTensors any ``torch.optim``
    optimizer trains, with gradients averaged over dp. The plan applied is
    ``result.autoshard_plan``. The user's model is never modified. The graph is captured for
    the shapes of ``example_inputs``; a call with other shapes raises a ``ValueError`` naming
    the input.

    Args:
        model: the single-device model. Built on the meta device, it is sharded from shapes:
            each rank's local shards are allocated uninitialized, for ``result.load_state_dict``
            to fill (non-persistent buffers the forward reads must hold values beforehand).
        mesh: a ``DeviceMesh`` with axes ``("dp", "tp")``, ``("dp",)``, ``("tp",)``, or for HSDP
            ``("dp_replicate", "dp_shard"[, "tp"])``; ``"pp"`` in front for pipeline stages, ``"cp"``
            before ``"tp"`` for context parallelism (``("dp", "cp", "tp")``, ``("cp",)``, ...): the
            sequence (dim 1 of the first input) cut over cp, see ``docs/context-parallel.md``;
            ``"ep"`` after the data axes for expert parallelism (``("dp", "ep")``, ``("ep", "cp", "tp")``,
            ...): each mixture-of-experts layer's experts split whole over ep, their tokens sent by
            all-to-all, see ``docs/expert-parallel.md``. Any accepted order composes with the others.

    Keyword Args:
        example_inputs: one rank's dp-local batch (a tuple of positional inputs).
        example_kwargs: its keyword inputs. A forward that takes ``use_cache`` (a Hugging Face
            decoder's KV cache, on by default) and is not given it here runs with
            ``use_cache=False``: the result returns the model's output without the cache.
        plan: a :class:`Plan` or its dict, applied instead of planning.
        options: an :class:`~autoshard.core.options.Options` (``autoshard.Options``), every keyword
            below grouped by what it configures (``tensor``, ``context``, ``pipeline``,
            ``precision``, ``capture``, ``sharding``); keywords given too are applied over it.
        sync_module_states: broadcast rank 0's weights first, so ranks that initialized
            differently still agree.
        reshard_after_forward: FSDP2's: blocks free their gathered parameters after forward.
        on_indivisible: a weight whose sharded dim does not divide by tp (a vocabulary of 50257
            on tp=2) is replicated over tp and the plan says why (``"replicate"``), or raises a
            ``ValueError`` naming it (``"error"``).
        loss_parallel: outputs sharded over their last dim (LM-head logits) are returned as
            DTensors ``Shard(-1)`` on the tp mesh, never gathered; compute the loss under
            ``torch.distributed.tensor.parallel.loss_parallel()``.
        dynamic_shapes: ``torch.export``'s spec (e.g. ``({0: Dim("batch"), 1: Dim("seq")},)``):
            those dims are captured symbolic, one plan and one graph for every batch and
            sequence length.
        sequence_parallel: norms, dropout and residual adds run sharded over the sequence; each
            rowwise all-reduce becomes a reduce-scatter and each colwise group's input an
            all-gather (reduce-scatter in backward).
        mp_policy: FSDP2's ``MixedPrecisionPolicy``, applied by every FSDP unit (master
            parameters and optimizer state stay fp32; parameters are all-gathered and computed
            in ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``). autoshard's tp
            collectives follow it: activations travel in ``param_dtype`` and every sum of partial
            values is taken in ``reduce_dtype``. Needs a dp axis, since FSDP2 applies the casts.
        buffer_dtype: under ``mp_policy``, the floating buffers held and computed in this dtype, as
            FSDP1's ``MixedPrecision(buffer_dtype=...)`` did (FSDP2 leaves them as they are): for a
            model whose float32 buffer (a rotary table) meets bf16 math in its own forward.
        activation_checkpointing: ``"full"`` recomputes each block in backward (its forward tp
            collectives included); ``"selective"`` keeps the outputs of matmuls, attention and
            tp collectives and recomputes the rest (no extra tp collective); ``None`` keeps
            every activation.
        all_gather_quant: an :class:`autoshard.BlockQuant`: each rank quantizes its tile of every
            2-D weight block by block right before FSDP's all-gather, which then carries 1-byte
            values and one fp32 scale per block; the gathered weight is dequantized before the
            matmul. Master weights, gradients and optimizer state are untouched. A weight whose
            tile does not divide by the block is gathered unquantized (the plan says why) unless
            ``BlockQuant(on_unaligned="error")``.
        trace_blocks_once: trace a stack of identical blocks (an ``nn.ModuleList``) as its first
            two and write the others from the second: the same graph and plan as tracing every
            block, in a fraction of the time. Blocks that differ are traced in full and the plan
            says why; ``False`` always traces all.
        check: prove the emitted tp code before any tensor is placed (see :func:`check`); a plan
            that fails raises :class:`~autoshard.proof.proof.ProofError` naming the first diverging
            node and its source line. ``"auto"`` proves when it costs little: a mesh with tp, a
            model holding values (not on meta) with at most :data:`AUTO_CHECK_MAX_ELEMENTS`
            parameter elements. ``True`` always, ``False`` never.

        loss_fn, microbatches, schedule, stages_per_rank, pp_split, memory_per_rank: a mesh with a
            ``pp`` axis (outermost: ``("pp", "dp", "tp")``, ``("pp", "tp")``, ...) cuts the model
            into pipeline stages, see ``docs/pipeline.md``. ``loss_fn(output, target)`` runs on the
            last stage, per microbatch; ``microbatches`` divides the dp-local batch (default: as
            many as stages); ``schedule`` is a ``torch.distributed.pipelining`` schedule name
            (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``), with
            ``stages_per_rank`` stages per pp rank for the interleaved ones (default 2);
            ``pp_split`` names the first block of every stage after the first (default: the split
            that balances the stages' FLOPs); ``memory_per_rank`` (bytes) bounds each stage's
            parameters, gradients, optimizer states and in-flight activations.
        context_output: on a mesh with a ``cp`` axis, outputs cut along the sequence come back
            all-gathered (``"whole"``, the default) or as this rank's positions (``"local"``,
            listed in ``result.cp_positions``), each rank's loss then being its share of the batch's.

    Returns:
        the sharded ``fx.GraphModule`` (its blocks are FSDP units); on a mesh with a ``pp`` axis a
        :class:`~autoshard.runtime.pipeline_stages.Pipeline` (``step(inputs, targets)``, ``parameters()``).

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        sharded = autoshard.autoshard(model, mesh, example_inputs=(tokens,))
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=3e-4)
    """
    chosen = Options.of(options, caller="autoshard", **keywords)
    return shard_model(model, mesh, example_inputs, example_kwargs, plan, chosen)
