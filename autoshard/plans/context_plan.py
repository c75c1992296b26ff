"""The cp decision recorded in a plan: how the sequence is cut and what is read whole.

Plan data, the cp axis's typed record in the plan (``Plan.context``), serialised with it, so that
printing, predicting and retargeting a plan never reach into the graph pass that made it
(``passes/cut_sequence.py``). It records what the cut did, never an input to it: a saved plan
applied again is cut afresh on the model's graph, for the mesh it is applied on.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """What cutting the sequence did: the sequence length, cp, the nodes whose input was gathered
    whole because they mix positions (``node: why``), the attention rewritten and the cut inputs;
    ``collectives``: ``(kind, bytes)`` of each cp collective one training step runs on one rank,
    forward and backward (what :func:`autoshard.plans.predict.predicted_comm` sums)."""

    seq: int
    cp: int
    gathered_whole: tuple[tuple[str, str], ...]
    attention: tuple[str, ...]
    entries: tuple[str, ...]
    # per flat graph output: the dim it is returned cut along (context_output="local"), or None (whole)
    output_cuts: tuple[int | None, ...] = ()
    collectives: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict:
        return {"seq": self.seq, "cp": self.cp, "gathered_whole": [list(g) for g in self.gathered_whole],
                "attention": list(self.attention), "entries": list(self.entries),
                "output_cuts": list(self.output_cuts), "collectives": [list(c) for c in self.collectives]}

    @classmethod
    def from_dict(cls, data) -> ContextPlan:
        gathered = tuple((str(n), str(w)) for n, w in data.get("gathered_whole", ()))
        collectives = tuple((str(kind), int(nbytes)) for kind, nbytes in data.get("collectives", ()))
        return cls(int(data["seq"]), int(data["cp"]), gathered, tuple(data.get("attention", ())),
                   tuple(data.get("entries", ())), tuple(data.get("output_cuts", ())), collectives)

    def lines(self) -> list[str]:
        out = [f"cp={self.cp}: sequence of {self.seq} cut in {2 * self.cp} chunks of {self.seq // (2 * self.cp)}, "
               f"rank r holding chunks r and {2 * self.cp - 1}-r"]
        out += [f"  attention over every rank's keys and values: {', '.join(self.attention)}"] if self.attention else []
        out += [f"  read whole (all-gathered): {name}: {why}" for name, why in self.gathered_whole]
        kept = [i for i, dim in enumerate(self.output_cuts) if dim is not None]
        if kept:
            out.append(f"  outputs {kept} returned cut (this rank's positions: result.cp_positions), the rest whole")
        return out
