"""Bytes on disk, and nothing of Keras or TensorFlow: what every checkpoint, export and run
directory is made of.

* ``atomic``: publish a file or directory whole or not at all (temporary sibling, rename).
* ``integrity``: the manifest of every file's size and SHA-256, written last, checked on load.
* ``locks``: one writing process per run directory, readers' leases.
* ``direct_io``: large new files written around the page cache, hashed on the way.
* ``limits``: bounds on what a checkpoint may ask a loader to allocate.
* ``targets``: what already stands at a checkpoint path, and whether a save may replace it.
* ``store``: object storage behind an ``s3://`` or ``gs://`` URL (fsspec, s3fs, gcsfs),
  errors as one line; ``gcs``: what ``gs://`` needs beyond it (generation preconditions).
* ``remote``: checkpoints on a store, published by a commit marker written last.
* ``cache``: the verified local copies of checkpoints read from a store, bounded.
* ``locations``: which locations are local paths, which are URLs of a store.
"""
