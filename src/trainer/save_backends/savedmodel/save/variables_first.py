"""Write a first save's variables while its functions are traced.

A first save spends most of its time in two things that do not depend on each other:
tracing the layers' functions (Python, holding the interpreter lock) and writing the
variables (TensorFlow's ``SaveV2``, which releases it: on the 8.5M-parameter benchmark
model, 97 MiB and 0.15-0.25 s, most of it the kernel handing out fresh pages). Done one
after the other inside ``tf.saved_model.save``, the second core idles through both. Here
the variables are written in a thread as soon as the save knows which they are
(``variable_plan.plan_variables``), and ``tf.saved_model.save`` then runs without writing
a checkpoint of its own (``tf_compat.save_without_checkpoint``).

The checkpoint is that of a module holding every variable the SavedModel's root holds,
by the same paths (``model_variables``, ``optimizer_variables``, and the layer nodes'
``state_variables``: a metric a layer updates, a stateful RNN's states): TensorFlow's own
keys (``model_variables/0/.ATTRIBUTES/VARIABLE_VALUE`` ...), and an object graph that
restores by those paths from the SavedModel's root, which is how ``tf.saved_model.load``
and TensorFlow's C++ loader match checkpoint entries to objects. What it leaves out are
nodes that hold no values (the signatures, the functions, a layer node's references to
weights the root's lists hold). A distributed variable or a layer resource (a lookup
table's entries) keeps TensorFlow's own checkpoint, and so do variables of less than
``WORTH_FROM`` bytes in all (a small model: nothing to gain).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import tensorflow as tf

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.bundle import variables_writer
from trainer.storage import direct_io


class VariablesWrite:
    """One checkpoint written in a thread; ``join`` waits for it and raises what it raised.

    Where every variable is one ``variables_writer.write_bundle`` writes, the thread writes
    the bundle itself, with TensorFlow's keys and object graph
    (``tf_compat.checkpoint_object_graph``): around the page cache, flushed as it is
    written and hashed on the way, so the save's own fsync finds the 97 MiB of the large
    benchmark model already on disk and the manifest need not hash them after the tracing.
    ``known`` then holds their sizes and digests. Elsewhere ``tf.train.Checkpoint`` writes it.
    """

    def __init__(self, holder: tf.Module, directory: Path, variables: list[tf.Variable]):
        self.folder = Path(directory) / "variables"
        self.prefix = str(self.folder / "variables")
        self.holder = holder
        self.own_writer = variables_writer.bundle_writable(variables) and direct_io.direct_wanted()
        self.known: dict[str, tuple[int, str]] = {}
        self.kept = False  # set by the save once these files are its checkpoint
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="trainer-variables", daemon=True)

    def start(self) -> VariablesWrite:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def _write(self) -> None:
        try:
            if not (self.own_writer and self._write_bundle()):
                tf.train.Checkpoint(self.holder).write(self.prefix)  # holder: the root
        except BaseException as err:  # re-raised by ``join`` in the saving thread
            self._error = err

    def _write_bundle(self) -> bool:
        graph = tf_compat.checkpoint_object_graph(self.holder)
        found = None if graph is None else variables_writer.match_keys(self.holder, graph)
        if not found:
            return False
        keys = sorted(found)
        written = variables_writer.write_bundle(
            self.prefix, keys, [found[k] for k in keys], graph.SerializeToString()
        )
        self.known = written.known
        return True

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def discard(self) -> None:
        """Wait for the write and remove what it wrote (the save goes another way)."""
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)


def start(plan: Any, directory: Path) -> VariablesWrite | None:
    """The variables of ``plan`` (``variable_plan.VariablePlan``) being written into
    ``directory``, or None where TensorFlow's own save must write them: a distributed
    variable, or a layer resource (a lookup table's checkpoint entries are its own)."""
    if not plan.plain_variables_only():
        return None
    holder = plan.checkpointed()
    variables = [
        *holder.model_variables,
        *holder.optimizer_variables,
        *(v for extra in plan.state for v in extra),
    ]
    if variables_writer.total_bytes(variables) < WORTH_FROM:
        return None
    return VariablesWrite(holder, directory, variables).start()


# Below this many bytes the write is mostly Python (walking and serializing the object
# graph), which gains nothing beside the tracing and costs its own object graph: the
# benchmark's small model (0.6 MiB) saved in 0.149-0.156 s this way against 0.146-0.150 s
# with TensorFlow's own checkpoint (medians of 5, alternating rounds, idle machine), its
# large one (97 MiB) in 0.655 s against 0.690 s (medians of 9).
WORTH_FROM = 8 << 20
