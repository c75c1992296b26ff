"""What autoshard suggests before a run: the mesh (:func:`~autoshard.advice.suggest.suggest_mesh`).

Above the driver, whose plans cost each candidate mesh: choosing the axes' sizes is the one job here
that names axes by design, so it is not the driver's (which names none).
"""
