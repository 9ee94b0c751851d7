"""Benchmarks of the save backends against Keras 3, tf_keras and the disk: see README.md."""
