"""The mesh axes, one module each, all keeping one contract (:mod:`autoshard.axes.contract`).

``dp_axis`` (dp and HSDP), ``tp_axis`` (tp), ``cp_axis`` (cp), ``ep_axis`` (ep) and
``pp_axis`` (pp). The driver runs them from one list, :data:`autoshard.driver.axis_list.AXES`.
"""
