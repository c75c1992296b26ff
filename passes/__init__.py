"""Graph passes of the autoshard pipeline, one stage a module.

capture -> discover -> propagate -> transpose -> layouts -> partition -> materialize

``autoshard.api`` is the only caller that runs them in order.
"""
