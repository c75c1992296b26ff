"""Graph passes of the autoshard pipeline, one stage a module.

capture (reuse_blocks, functions) -> discover (experts) -> normalize -> propagate (layout_rules,
dtensor_rules, decompose) -> alternatives -> placements (the plan) -> layouts -> transpose -> partition
-> [simulate: the proof] -> materialize -> checkpointing -> verify

``autoshard.api`` is the only caller that runs them in order.
"""
