"""The package version, in its own module so that any module can read it without a cycle."""

__version__ = "0.1.0"
"""trainer's version (also ``trainer.__version__``), recorded in every checkpoint's metadata."""
