"""Keras variables created without running their initializers, for loads that overwrite them.

A load rebuilds layers from their configs, and ``build`` creates every variable by running
its initializer: random kernels of the model's whole size that the stored values then
replace (on the large benchmark model, 97 MiB of random numbers: about a quarter of a
class-missing load). Keras 3 has no public way to create a layer's variables without
initializing them, so this module replaces the one private method that does it,
``Variable._initialize_with_initializer`` of the TensorFlow backend, by a version that, in
a thread inside :class:`DeferredInitializers`, starts the variable at zeros (cheap, and
deterministic should anything go wrong) and remembers the initializer. Outside such a
block, and in every other thread, the original method runs unchanged.

Nothing is left at zeros by mistake: :meth:`DeferredInitializers.initialize_rest` runs the
real initializer of every variable that the load neither gave a stored value nor pointed
at loaded storage. Checked: Keras 3.15.1, TensorFlow backend (``tests/_compat/test_canaries.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf

_active = threading.local()
_install_lock = threading.Lock()
_original: Any = None


def _deferring(variable: Any, initializer: Any) -> None:
    """``Variable._initialize_with_initializer``, deferred inside a block of this thread."""
    block = getattr(_active, "block", None)
    try:
        dtype = tf.as_dtype(variable._dtype)
        numeric = dtype.is_floating or dtype.is_integer or dtype.is_bool
    except TypeError:  # a dtype TensorFlow has no zeros for: initialize as Keras would
        numeric = False
    if block is None or not numeric:
        _original(variable, initializer)
        return
    shape = variable._shape
    variable._initialize(lambda: tf.zeros(shape, dtype=dtype))
    block.pending[id(variable)] = (variable, variable._value, initializer)


def _install() -> None:
    """Replace the method once per process; it behaves as before outside a block."""
    global _original
    with _install_lock:
        if _original is not None:
            return
        cls = keras.Variable
        _original = cls._initialize_with_initializer
        cls._initialize_with_initializer = _deferring


class DeferredInitializers:
    """Within ``with DeferredInitializers() as deferred:``, Keras variables created by this
    thread start at zeros; after giving the loaded values, ``deferred.initialize_rest``
    initializes the others as Keras would have."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[keras.Variable, Any, Any]] = {}
        self._outer: DeferredInitializers | None = None

    def __enter__(self) -> DeferredInitializers:
        _install()
        self._outer = getattr(_active, "block", None)
        _active.block = self
        return self

    def __exit__(self, *exc: object) -> None:
        _active.block = self._outer

    def initialize_rest(self, given: Iterable[keras.Variable]) -> int:
        """Run the initializer of every deferred variable that is not in ``given`` (those
        assigned their stored values) and still has the storage it was created with (a
        variable pointed at loaded storage has its value). Returns how many ran."""
        given_ids = {id(v) for v in given}
        ran = 0
        for key, (variable, placeholder, initializer) in self.pending.items():
            if key in given_ids or variable._value is not placeholder:
                continue
            variable.assign(initializer(variable.shape, dtype=variable.dtype))
            ran += 1
        self.pending.clear()
        return ran
