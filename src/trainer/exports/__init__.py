"""Serving exports: ``export/<version>/`` SavedModels a model server can watch.

* ``exporter``: write and read one export version, retention of versions.
* ``sources``: an export of a saved checkpoint, or of the run that just finished.
* ``warmup``: TF Serving warmup requests inside an export.
"""
