"""Scripts tests start as child processes (``python tests/children/NAME.py ...``): each
runs with this folder first on ``sys.path``, so siblings import each other by bare name
(``from disk_fault_child import ...``, Hydra targets such as ``disk_fault_child.X``)."""
