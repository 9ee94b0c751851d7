"""Bytes on disk, and nothing of Keras or TensorFlow: what every checkpoint, export and run
directory is made of.

* ``atomic``: publish a file or directory whole or not at all (temporary sibling, rename).
* ``integrity``: the manifest of every file's size and SHA-256, written last, checked on load.
* ``locks``: one writing process per run directory, readers' leases.
* ``direct_io``: large new files written around the page cache, hashed on the way.
* ``limits``: bounds on what a checkpoint may ask a loader to allocate.
* ``targets``: what already stands at a checkpoint path, and whether a save may replace it.
"""
