"""Write a first save's variables while its functions are traced.

A first save spends most of its time in two things that do not depend on each other:
tracing the layers' functions (Python, holding the interpreter lock) and writing the
variables (TensorFlow's ``SaveV2``, which releases it: on the 8.5M-parameter benchmark
model, 97 MiB and 0.15-0.25 s, most of it the kernel handing out fresh pages). Done one
after the other inside ``tf.saved_model.save``, the second core idles through both. Here
the variables are written in a thread as soon as the save knows which they are
(``object_graph.plan_variables``), and ``tf.saved_model.save`` then runs without writing
a checkpoint of its own (``tf_compat.save_without_checkpoint``).

The checkpoint is that of a module holding the root's two variable lists under their
names (``model_variables``, ``optimizer_variables``): the same keys as TensorFlow's own
(``model_variables/0/.ATTRIBUTES/VARIABLE_VALUE`` ...), and an object graph that restores
by the same paths from the SavedModel's root, which is how ``tf.saved_model.load`` and
TensorFlow's C++ loader match checkpoint entries to objects.
What it leaves out are nodes that hold no values (the per-layer nodes reach the same
variables, the signatures none). Only for plain variables: a distributed variable or a
layer resource (a lookup table has entries of its own) keeps TensorFlow's own checkpoint.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import tensorflow as tf


class VariablesWrite:
    """One checkpoint written in a thread; ``join`` waits for it and raises what it raised."""

    def __init__(self, lists: dict[str, list[tf.Variable]], directory: Path):
        self.folder = Path(directory) / "variables"
        self.prefix = str(self.folder / "variables")
        holder = tf.Module()  # what the root is, with only its variables
        for name, variables in lists.items():
            setattr(holder, name, variables)
        self._checkpoint = tf.train.Checkpoint(holder)  # positional: the holder is the root
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="trainer-variables", daemon=True)

    def start(self) -> VariablesWrite:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def _write(self) -> None:
        try:
            self._checkpoint.write(self.prefix)
        except BaseException as err:  # re-raised by ``join`` in the saving thread
            self._error = err

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def discard(self) -> None:
        """Wait for the write and remove what it wrote (the save goes another way)."""
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(plan: Any, directory: Path) -> VariablesWrite | None:
    """The variables of ``plan`` being written into ``directory``, or None where they
    are not all plain variables (TensorFlow's own save writes those)."""
    lists = plan.root_lists()
    if any(
        isinstance(v, tf.distribute.DistributedValues) or not isinstance(v, tf.Variable)
        for variables in lists.values()
        for v in variables
    ):
        return None
    return VariablesWrite(lists, directory).start()
