"""Options: one object, defined once, taken by ``autoshard()``, ``plan()``, ``check()``,
``autoshard.testing.check()`` and the compile backend.

:class:`Options` groups every option by the axis or concern it configures (``tensor``,
``context``, ``pipeline``, ``precision``, ``capture``, ``sharding``). The public functions take
it as ``options=`` and, as before, each option as a keyword of its own (:data:`KEYWORDS` maps a
keyword to its group and field); keywords are applied over ``options``. The graph passes read
:class:`PlanOptions`, the planning subset, one frozen object handed through capture, propagation
and retargeting instead of a positional chain of flags.
"""

from __future__ import annotations

import dataclasses

from autoshard.core.quant_format import BlockQuant

ON_INDIVISIBLE = ("replicate", "error")
CONTEXT_OUTPUTS = ("whole", "local")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """``on_indivisible``: replicate over tp (noted) or refuse a weight whose sharded dim does
    not divide by tp. ``loss_parallel``: outputs sharded over their last dim leave as DTensors.
    ``sequence_parallel``: the residual stream is sharded over the sequence between blocks.
    ``dynamic_shapes``: ``torch.export``'s spec for symbolic batch and sequence dims.
    ``mp_policy``: FSDP2's mixed-precision policy, which autoshard's tp sums follow too.
    ``all_gather_quant``: a :class:`~autoshard.plans.block_quant.BlockQuant` for FSDP's all-gathers.
    ``trace_blocks_once``: trace a stack of identical blocks as two and write the rest
    (the same graph, much faster on deep models); ``False`` traces every block.
    ``context_output``: on a mesh with a cp axis, outputs cut along the sequence come back
    gathered (``"whole"``) or as each rank's positions (``"local"``)."""

    on_indivisible: str = "replicate"
    loss_parallel: bool = False
    sequence_parallel: bool = False
    dynamic_shapes: object = None
    mp_policy: object = None  # torch.distributed.fsdp.MixedPrecisionPolicy
    all_gather_quant: object = None  # autoshard.BlockQuant
    trace_blocks_once: bool = True
    context_output: str = "whole"  # on a cp axis: outputs gathered whole, or "local": left cut
    buffer_dtype: object = None  # under mp_policy: floating buffers computed in this dtype (FSDP1's buffer_dtype)

    def __post_init__(self) -> None:
        if self.context_output not in CONTEXT_OUTPUTS:
            raise ValueError(f"autoshard: context_output must be 'whole' or 'local', got {self.context_output!r}")
        if self.on_indivisible not in ON_INDIVISIBLE:
            raise ValueError(
                f"autoshard: on_indivisible must be 'replicate' or 'error', got {self.on_indivisible!r}"
            )
        if self.buffer_dtype is not None and self.mp_policy is None:
            raise ValueError("autoshard: buffer_dtype casts buffers under mixed precision; pass mp_policy too")
        if self.all_gather_quant is not None and not isinstance(self.all_gather_quant, BlockQuant):
            raise ValueError(
                "autoshard: all_gather_quant must be an autoshard.BlockQuant (e.g. "
                f"BlockQuant(dtype=torch.float8_e4m3fn, block=128)), got {type(self.all_gather_quant).__name__}"
            )

    def for_tp(self, has_tp: bool) -> PlanOptions:
        """Loss and sequence parallelism exist only with a tp axis."""
        if has_tp:
            return self
        return dataclasses.replace(self, loss_parallel=False, sequence_parallel=False)

    def strict(self) -> PlanOptions:
        """Every weight's role must hold as planned (retargeting checks a saved plan)."""
        return dataclasses.replace(self, on_indivisible="error")


DEFAULT_OPTIONS = PlanOptions()


@dataclasses.dataclass(frozen=True)
class TensorOptions:
    """Tensor parallelism (a ``tp`` axis).

    ``on_indivisible``: a weight whose sharded dim does not divide by tp is replicated over tp and
    the plan says why (``"replicate"``), or raises a ``ValueError`` naming it (``"error"``).
    ``loss_parallel``: outputs sharded over their last dim (LM-head logits) are returned as
    DTensors ``Shard(-1)`` on the tp mesh; compute the loss under torch's ``loss_parallel()``.
    ``sequence_parallel``: norms, dropout and residual adds run cut over the sequence between
    blocks (each rowwise all-reduce a reduce-scatter, each colwise group's input an all-gather)."""

    on_indivisible: str = "replicate"
    loss_parallel: bool = False
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class ContextOptions:
    """Context parallelism (a ``cp`` axis). ``output``: outputs cut along the sequence come back
    all-gathered (``"whole"``) or as this rank's positions (``"local"``, listed in the result's
    ``cp_positions``)."""

    output: str = "whole"


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Pipeline stages (a ``pp`` axis, see ``docs/pipeline.md``).

    ``loss_fn(output, target)`` runs on the last stage per microbatch; ``microbatches`` divides
    the dp-local batch (default: as many as stages); ``schedule`` is a
    ``torch.distributed.pipelining`` schedule name, with ``stages_per_rank`` stages per rank for
    the interleaved ones; ``split`` names the first block of every stage after the first (default:
    the split that balances the stages' FLOPs); ``memory_per_rank`` (bytes) bounds each stage."""

    loss_fn: object = None
    microbatches: int | None = None
    schedule: str = "1F1B"
    stages_per_rank: int | None = None
    split: object = None
    memory_per_rank: int | None = None

    def configured(self) -> list[str]:
        """The keywords set away from their defaults (each configures stages: a pp axis needs them)."""
        default = PipelineOptions()
        return [_PIPELINE_KEYWORD.get(f.name, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)]


@dataclasses.dataclass(frozen=True)
class PrecisionOptions:
    """``mp_policy``: FSDP2's ``MixedPrecisionPolicy``, applied by every FSDP unit and followed by
    autoshard's tp collectives (activations travel in ``param_dtype``, sums of partial values are
    taken in ``reduce_dtype``); it needs a dp axis. ``all_gather_quant``: an
    :class:`autoshard.BlockQuant` for FSDP's all-gathers. ``buffer_dtype``: under ``mp_policy``,
    the floating buffers (a rotary table, a mask) held and computed in this dtype, as FSDP1's
    ``MixedPrecision(buffer_dtype=...)`` did; by default they stay as they are, as FSDP2 leaves
    them. A model whose float32 buffer meets bf16 math in its own forward needs it."""

    mp_policy: object = None
    all_gather_quant: object = None
    buffer_dtype: object = None


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """``dynamic_shapes``: ``torch.export``'s spec, those dims captured symbolic (one plan for every
    batch and sequence length). ``trace_blocks_once``: trace a stack of identical blocks as its
    first two and write the rest (the same graph, much faster on deep models)."""

    dynamic_shapes: object = None
    trace_blocks_once: bool = True


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """What ``autoshard()`` does beyond the plan. ``check``: prove the emitted code first
    (``"auto"``: when it costs little; ``True``; ``False``). ``sync_module_states``: broadcast rank
    0's weights first. ``reshard_after_forward``: FSDP2's. ``activation_checkpointing``: ``"full"``,
    ``"selective"`` or ``None``."""

    check: object = "auto"
    sync_module_states: bool = True
    reshard_after_forward: bool = True
    activation_checkpointing: str | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option, grouped; see each group's docstring. Build it with keywords
    (``Options.of(sequence_parallel=True, mp_policy=policy)``) or by group
    (``Options(tensor=TensorOptions(sequence_parallel=True))``); pass it as ``options=`` to
    ``autoshard()``, ``plan()``, ``check()`` or ``autoshard.backend()``."""

    tensor: TensorOptions = TensorOptions()
    context: ContextOptions = ContextOptions()
    pipeline: PipelineOptions = PipelineOptions()
    precision: PrecisionOptions = PrecisionOptions()
    capture: CaptureOptions = CaptureOptions()
    sharding: ShardingOptions = ShardingOptions()

    @classmethod
    def of(cls, options: Options | None = None, *, caller: str = "autoshard", refused: tuple[str, ...] = (),
           **keywords) -> Options:
        """``options`` (default: all defaults) with each keyword of :data:`KEYWORDS` applied over it;
        a keyword ``caller`` does not take (``refused``) or that no option has is a ``TypeError``."""
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"{caller}() options must be an autoshard.Options, got {type(options).__name__}")
        result = options if options is not None else cls()
        for keyword, value in keywords.items():
            if keyword not in KEYWORDS or keyword in refused:
                raise TypeError(f"{caller}() got an unexpected keyword argument {keyword!r}")
            group, field = KEYWORDS[keyword]
            grouped = dataclasses.replace(getattr(result, group), **{field: value})
            result = dataclasses.replace(result, **{group: grouped})
        return result

    def changed(self) -> dict[str, object]:
        """The options set away from their defaults, by keyword (what a report lists)."""
        default = Options()
        return {keyword: value for keyword, (group, field) in KEYWORDS.items()
                if (value := getattr(getattr(self, group), field)) is not getattr(getattr(default, group), field)
                and value != getattr(getattr(default, group), field)}

    def plan_options(self) -> PlanOptions:
        """The planning subset the graph passes read."""
        return PlanOptions(self.tensor.on_indivisible, self.tensor.loss_parallel, self.tensor.sequence_parallel,
                           self.capture.dynamic_shapes, self.precision.mp_policy, self.precision.all_gather_quant,
                           self.capture.trace_blocks_once, self.context.output, self.precision.buffer_dtype)


_PIPELINE_KEYWORD = {"split": "pp_split"}
# keyword -> (group, field): today's keyword names, each one option of one group
KEYWORDS: dict[str, tuple[str, str]] = {
    "on_indivisible": ("tensor", "on_indivisible"),
    "loss_parallel": ("tensor", "loss_parallel"),
    "sequence_parallel": ("tensor", "sequence_parallel"),
    "context_output": ("context", "output"),
    "loss_fn": ("pipeline", "loss_fn"),
    "microbatches": ("pipeline", "microbatches"),
    "schedule": ("pipeline", "schedule"),
    "stages_per_rank": ("pipeline", "stages_per_rank"),
    "pp_split": ("pipeline", "split"),
    "memory_per_rank": ("pipeline", "memory_per_rank"),
    "mp_policy": ("precision", "mp_policy"),
    "all_gather_quant": ("precision", "all_gather_quant"),
    "buffer_dtype": ("precision", "buffer_dtype"),
    "dynamic_shapes": ("capture", "dynamic_shapes"),
    "trace_blocks_once": ("capture", "trace_blocks_once"),
    "check": ("sharding", "check"),
    "sync_module_states": ("sharding", "sync_module_states"),
    "reshard_after_forward": ("sharding", "reshard_after_forward"),
    "activation_checkpointing": ("sharding", "activation_checkpointing"),
}
# what only autoshard() does with a process group: plan() and check() refuse these keywords
SHARDING_KEYWORDS = tuple(k for k, (group, _) in KEYWORDS.items() if group == "sharding") + ("loss_fn",)
