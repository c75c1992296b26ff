"""The cp decision recorded in a plan: how the sequence is cut and what is read whole.

Plan data, kept with the plan (``Plan.context`` holds its ``to_dict()``), so that printing and
retargeting a plan never reaches into the graph pass that made it (``passes/cut_sequence.py``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """What cutting the sequence did: the sequence length, cp, the nodes whose input was gathered
    whole because they mix positions (``node: why``), the attention rewritten and the cut inputs."""

    seq: int
    cp: int
    gathered_whole: tuple[tuple[str, str], ...]
    attention: tuple[str, ...]
    entries: tuple[str, ...]
    # per flat graph output: the dim it is returned cut along (context_output="local"), or None (whole)
    output_cuts: tuple[int | None, ...] = ()

    def to_dict(self) -> dict:
        return {"seq": self.seq, "cp": self.cp, "gathered_whole": [list(g) for g in self.gathered_whole],
                "attention": list(self.attention), "entries": list(self.entries),
                "output_cuts": list(self.output_cuts)}

    @classmethod
    def from_dict(cls, data) -> ContextPlan:
        gathered = tuple((str(n), str(w)) for n, w in data.get("gathered_whole", ()))
        return cls(int(data["seq"]), int(data["cp"]), gathered, tuple(data.get("attention", ())),
                   tuple(data.get("entries", ())), tuple(data.get("output_cuts", ())))

    def lines(self) -> list[str]:
        out = [f"cp={self.cp}: sequence of {self.seq} cut in {2 * self.cp} chunks of {self.seq // (2 * self.cp)}, "
               f"rank r holding chunks r and {2 * self.cp - 1}-r"]
        out += [f"  attention over every rank's keys and values: {', '.join(self.attention)}"] if self.attention else []
        out += [f"  read whole (all-gathered): {name}: {why}" for name, why in self.gathered_whole]
        kept = [i for i, dim in enumerate(self.output_cuts) if dim is not None]
        if kept:
            out.append(f"  outputs {kept} returned cut (this rank's positions: result.cp_positions), the rest whole")
        return out
