"""Write every tf_keras fixture of ``tests/save_backends/legacy/`` in ONE process:
``python tests/children/legacy_writers.py OUT`` writes the import zoo
(``legacy_fixtures.py``) into ``OUT/zoo`` and the state-beyond-weights models
(``legacy_state_fixtures.py``) into ``OUT/state``.

tf_keras must never share a process with Keras 3, so the fixtures are written by a child;
one child for both sets pays the TensorFlow and tf_keras import once, not twice (each
writer still runs on its own as before, for one set or a few cases).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import legacy_fixtures
import legacy_state_fixtures
import tf_keras as k

if __name__ == "__main__":
    out = sys.argv[1]
    legacy_fixtures.write_all(os.path.join(out, "zoo"))
    # Fresh layer-name counters and graph state, as in a process of its own: the state
    # fixtures then name and seed their layers exactly as when written alone.
    k.backend.clear_session()
    legacy_state_fixtures.write_all(os.path.join(out, "state"))
