"""Graph passes of the autoshard pipeline, one stage a module.

capture -> discover -> propagate -> layouts -> transpose -> partition -> materialize -> verify

``autoshard.api`` is the only caller that runs them in order.
"""
