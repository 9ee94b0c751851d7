"""The runs of an outputs directory and the sessions of one run (each start or resume).

* ``index``: every run with its checkpoints, exports and TensorBoard run (``trainer runs``).
* ``sessions``: the session records ``train.py`` writes into a run directory.
"""
