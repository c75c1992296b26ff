"""Rounding: what a sharded run's error is held to, told apart from the model's own rounding.

A sharded run never agrees with one device to the bit: its matmuls sum in another
order, each tp rank rounds its partial sum to the compute dtype before the sum,
a norm over a cut width adds its statistic from pieces. In fp32 that is ~1e-7 and
any fixed bound far above it (1e-4) proves the plan. In bf16 the model's own
rounding is ~1e-2, the same size as many plan bugs, so a fixed bound would both
refuse right plans whose rounding lands near it and pass a wrong plan whose error
lands under it.

So the proof asks the question a user training in bf16 asks: *does sharding cost
more accuracy than running the model in this dtype on one device?* The same graph
runs a third time in float64 from the same rounded weights, inputs and
cotangents (every float dtype the graph names widened: a cast to bf16 in the
model's code is exact there). For every output and gradient:

* ``sharded``: the sharded run's distance from the float64 run,
* ``one_device``: the unsharded run's distance from it,

both relative to the float64 value's size. The plan is proven when ``sharded <=
FACTOR * one_device + floor``, the floor one unit of rounding of the tensor itself
(``unit_roundoff(dtype)`` of its size: a value one device computes exactly, a
lookup, may still round once when sharded). A tensor that is zero in exact
arithmetic (a bias ahead of a training-mode batch norm: its gradient is pure
cancellation noise on one device too) carries no signal; it is held only to the
noise level of the model's typical gradient (``sqrt(unit_roundoff)`` of it), so it
never fails on noise while a wrong plan, which makes it signal-sized, still does.

``FACTOR`` is set from measurements: right plans of the test matrix land within 1.6x
of one device; plans broken on purpose land at 20x and beyond.

Where a tensor exceeds it, the emitted code itself runs once more in float64 (every
collective's sum too) and is compared with the model in float64. A right plan computes
the model's function, so there its error shrinks with the rounding: to float64's own
precision (``WIDE_AGREEMENT`` units of it), or by ``WIDE_SHRINK`` at the least in a model
whose own rounding is amplified (SwiftFormer's training-mode batch norms over a few
values: one device is 1e-3 from float64 in fp32, and the sharded code 9e-3 in fp32 but
2e-11 in float64). A wrong plan's error does not shrink (HY-V4: 1.2e-3 in fp32 and in
float64). What remains in bf16 is then where the sharded code rounds, not what it
computes. That happens where a value is a sum that cancels: the gradient of
a small replicated parameter (Doge's ``A``) is the sum of every tp rank's partial
gradient, each rounded to bf16 on its rank, and when the partials are much larger than
their sum, their roundings are much larger than one device's single rounding of the sum.
Such a tensor is proven and reported as rounding only, with its factor. A wrong plan
differs in float64 as much as in bf16. Precision bugs that compute the right function
with roundings in the wrong places (a sum in bf16 the model takes in float32) are the
dtype audit's (:mod:`autoshard.proof.precision`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

FACTOR = 4.0
# the emitted code in float64 agrees with the model in float64 to this many units of float64's rounding,
# or its error there is at most this share of its error in the compute dtype
WIDE_AGREEMENT = 1e4
WIDE_SHRINK = 1e-3
# a tensor whose float64 value is this small next to one device's own error is zero in exact arithmetic
_NOISE_ONLY = 1e-2


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next float of ``dtype``: the relative error of one rounding."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


@dataclasses.dataclass(frozen=True)
class Measure:
    """One output or gradient of a proof.

    ``error`` is the sharded run against the unsharded one (relative to the unsharded value):
    what a user compares when checking against one device. With a float64 run, ``sharded`` and
    ``one_device`` are each run's distance from it and ``allowed`` bounds ``sharded``; without
    one (the graph does not run widened, or an explicit ``rtol`` was given), ``allowed`` bounds
    ``error``. All relative to the reference value's size.
    """

    what: str
    error: float
    sharded: float | None = None
    one_device: float | None = None
    allowed: float = 0.0
    # the emitted code run in float64 too, against the model in float64 (relative): set where
    # ``sharded`` exceeds ``allowed``, to tell rounding from a wrong plan
    wide_sharded: float | None = None
    wide_dtype: torch.dtype | None = None

    @property
    def judged(self) -> float:
        """The number held to ``allowed``."""
        return self.error if self.sharded is None else self.sharded

    @property
    def rounding_only(self) -> bool:
        """Beyond ``allowed``, yet the sharded code computes the model's function: in float64 its
        error shrinks with the rounding (to float64's own precision, or by ``WIDE_SHRINK`` at the
        least), where a wrong plan's stays what it was. What is left is where it rounds."""
        if self.wide_sharded is None:
            return False
        return self.wide_sharded <= max(WIDE_AGREEMENT * unit_roundoff(self.wide_dtype), WIDE_SHRINK * self.judged)

    @property
    def ok(self) -> bool:
        return self.judged <= self.allowed or self.rounding_only

    @property
    def factor(self) -> float | None:
        """How many times one device's own error the sharded run's is."""
        if self.sharded is None or self.one_device is None:
            return None
        if self.one_device == 0:
            return 1.0 if self.sharded == 0 else math.inf
        return self.sharded / self.one_device

    def __str__(self) -> str:
        if self.sharded is None:
            return f"{self.what}: {self.error:.2e} against one device (allowed {self.allowed:.0e})"
        if self.one_device is None:  # the cp proof: the code in float64 against the model in float64
            return (f"{self.what}: {self.sharded:.2e} in float64 (allowed {self.allowed:.0e}), {self.error:.2e} in "
                    f"the model's dtype")
        text = (f"{self.what}: {self.sharded:.2e} from float64 sharded, {self.one_device:.2e} on one device "
                f"(x{self.factor:.2g}; allowed {self.allowed:.2e}), {self.error:.2e} between them")
        if self.wide_sharded is not None:
            verdict = "rounding only" if self.rounding_only else "a wrong plan"
            wide = str(self.wide_dtype).removeprefix("torch.")
            text += f"; the sharded code in {wide}: {self.wide_sharded:.1e} ({verdict})"
        return text


def judge(what: str, error: float, sharded: float, one_device: float, size: float, noise_scale: float,
          dtype: torch.dtype, tolerance: float) -> Measure:
    """The measure of one tensor from absolute distances to its float64 value.

    ``sharded`` and ``one_device`` are the runs' distances (Frobenius norms), ``size`` the float64
    value's norm, ``noise_scale`` the norm a tensor of this shape has at the model's typical
    magnitude (the floor of what counts as signal), ``dtype`` the compute dtype. Where one device
    itself overflows there is no rounding to compare with: ``error`` is held to ``tolerance``."""
    if not (math.isfinite(one_device) and math.isfinite(size)):
        return Measure(what, error, allowed=tolerance)
    u = unit_roundoff(dtype)
    scale = max(size, noise_scale * u, 1e-30)
    if size <= _NOISE_ONLY * one_device:  # zero in exact arithmetic
        scale = max(noise_scale, 1e-30)
        allowed = max(FACTOR * one_device, math.sqrt(u) * noise_scale)
    else:
        allowed = FACTOR * one_device + u * size
    return Measure(what, error, sharded / scale, one_device / scale, allowed / scale)
