"""The configs tf_keras (Keras 2) writes for its own built-in layers, and what the legacy
import derives from them (``trainer/save_backends/legacy/builtin.py``): the class names
Keras 2 recorded for built-ins, and the option keys Keras 3 added, dropped or renamed.

Two modes, each its own process (tf_keras and Keras 3 never share one):

- ``python tests/children/legacy_builtin_configs.py OUT.json`` (tf_keras): for every layer class of
  ``tf_keras.layers`` (the Keras 3 side keeps those Keras 3 also has), the ``class_name``
  and ``config`` that ``model.save`` records in ``keras_metadata.pb`` for an instance with
  default options (dummy values for required ones). ``legacy_fixtures.py`` writes it too.
- ``python tests/children/legacy_builtin_configs.py --table`` (Keras 3, the dev script): runs
  the first mode in a subprocess, then prints the class list and key tables of ``builtin.py``
  as they should read. ``tests/save_backends/legacy/test_import_zoo.py`` checks them against
  the zoo's run.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Dummy values for the options a class cannot be built without (tf_keras names).
REQUIRED = {
    "Activation": {"activation": "relu"},
    "AlphaDropout": {"rate": 0.1},
    "Bidirectional": {"layer": ("LSTM", {"units": 2})},
    "CategoryEncoding": {"num_tokens": 4},
    "CenterCrop": {"height": 2, "width": 2},
    "Conv1D": {"filters": 2, "kernel_size": 3},
    "Conv1DTranspose": {"filters": 2, "kernel_size": 3},
    "Conv2D": {"filters": 2, "kernel_size": 3},
    "Conv2DTranspose": {"filters": 2, "kernel_size": 3},
    "Conv3D": {"filters": 2, "kernel_size": 3},
    "Conv3DTranspose": {"filters": 2, "kernel_size": 3},
    "ConvLSTM1D": {"filters": 2, "kernel_size": 3},
    "ConvLSTM2D": {"filters": 2, "kernel_size": 3},
    "ConvLSTM3D": {"filters": 2, "kernel_size": 3},
    "Dense": {"units": 2},
    "DenseFeatures": {"feature_columns": []},
    "DepthwiseConv1D": {"kernel_size": 3},
    "DepthwiseConv2D": {"kernel_size": 3},
    "Dot": {"axes": 1},
    "Dropout": {"rate": 0.1},
    "EinsumDense": {"equation": "ab,bc->ac", "output_shape": 2},
    "Embedding": {"input_dim": 4, "output_dim": 2},
    "GRU": {"units": 2},
    "GRUCell": {"units": 2},
    "GaussianDropout": {"rate": 0.1},
    "GaussianNoise": {"stddev": 0.1},
    "Discretization": {"bin_boundaries": [0.0, 1.0]},
    "HashedCrossing": {"num_bins": 4},
    "Hashing": {"num_bins": 4},
    "InputLayer": {"input_shape": (2,)},
    # A lookup without a vocabulary (adapted later) is refused by the import (its
    # vocabulary is in a lookup table it cannot read): one given here is in the config.
    "IntegerLookup": {"vocabulary": [1]},
    "LSTM": {"units": 2},
    "LSTMCell": {"units": 2},
    "LocallyConnected1D": {"filters": 2, "kernel_size": 3},
    "LocallyConnected2D": {"filters": 2, "kernel_size": 3},
    "MultiHeadAttention": {"num_heads": 2, "key_dim": 2},
    "Permute": {"dims": (2, 1)},
    "RNN": {"cell": ("SimpleRNNCell", {"units": 2})},
    "RandomContrast": {"factor": 0.1},
    "RandomBrightness": {"factor": 0.1},
    "RandomCrop": {"height": 2, "width": 2},
    "RandomHeight": {"factor": 0.1},
    "RandomRotation": {"factor": 0.1},
    "RandomTranslation": {"height_factor": 0.1, "width_factor": 0.1},
    "RandomWidth": {"factor": 0.1},
    "RandomZoom": {"height_factor": 0.1},
    "RepeatVector": {"n": 2},
    "Rescaling": {"scale": 0.5},
    "Reshape": {"target_shape": (2, 2)},
    "Resizing": {"height": 2, "width": 2},
    "SeparableConv1D": {"filters": 2, "kernel_size": 3},
    "SeparableConv2D": {"filters": 2, "kernel_size": 3},
    "SimpleRNN": {"units": 2},
    "SimpleRNNCell": {"units": 2},
    "SpatialDropout1D": {"rate": 0.1},
    "SpatialDropout2D": {"rate": 0.1},
    "SpatialDropout3D": {"rate": 0.1},
    "StringLookup": {"vocabulary": ["a"]},
    "SpectralNormalization": {"layer": ("Dense", {"units": 2})},
    "StackedRNNCells": {"cells": [("SimpleRNNCell", {"units": 2})]},
    "TextVectorization": {"vocabulary": ["a"]},
    "TimeDistributed": {"layer": ("Dense", {"units": 2})},
}
# Abstract bases: a legacy file never names them for a layer of Keras' own.
# Lambda: always revived from its traces (its config carries code), never checked.
SKIPPED = ("AbstractRNNCell", "Lambda", "Layer", "Wrapper")


def _value(layers, value):
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return getattr(layers, value[0])(**value[1])
    if isinstance(value, list):
        return [_value(layers, v) for v in value]
    return value


def write_configs(path: str) -> None:
    """``{attribute: {"class_name", "config"}}`` as ``keras_metadata.pb`` records them (the
    saved model's ``_tracking_metadata``), for every Layer class of ``tf_keras.layers``
    (aliases included: they record the class they alias). tf_keras side only."""
    import tf_keras

    layers = tf_keras.layers
    found = {}
    for attribute in sorted(dir(layers)):
        cls = getattr(layers, attribute)
        if not isinstance(cls, type) or not issubclass(cls, layers.Layer):
            continue
        if attribute in SKIPPED:
            continue
        required = REQUIRED.get(cls.__name__, {})
        kwargs = {k: _value(layers, v) for k, v in required.items()}
        try:
            metadata = json.loads(cls(**kwargs)._tracking_metadata)
        except Exception as error:  # no dummy arguments for it: the other side decides
            found[attribute] = {"error": f"{type(error).__name__}: {error}"}
            continue
        found[attribute] = {"class_name": metadata["class_name"], "config": metadata["config"]}
    with open(path, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)


def _generate() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "configs.json")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        env.pop("KERAS_BACKEND", None)
        subprocess.run([sys.executable, __file__, out], env=env, check=True)
        with open(out) as f:
            return json.load(f)


def derive(configs: dict) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
    """From ``write_configs``' output (Keras 3 side): the class names tf_keras recorded for
    built-ins Keras 3 also has, and per class the keys only Keras 3's default config has
    and those only tf_keras' has (where Keras 3 builds the class). A class Keras 3 has that
    tf_keras could not build here fails: add its required arguments to ``REQUIRED``."""
    from trainer.save_backends.legacy import builtin, translate

    names, keras3_only, keras2_only = set(), {}, {}
    for attribute, entry in sorted(configs.items()):
        if not builtin.names_builtin(attribute):
            continue
        assert "error" not in entry, f"{attribute}: {entry.get('error')}"
        class_name, config = entry["class_name"], translate.plain(entry["config"])
        names.add(class_name)
        theirs = builtin.keras3_keys(class_name, config)
        ours = set(config) | builtin.translated_keys(class_name, config)
        if theirs - ours:
            keras3_only[class_name] = sorted(theirs - ours)
        if theirs and set(config) - theirs:
            keras2_only[class_name] = sorted(set(config) - theirs)
    return sorted(names), keras3_only, keras2_only


def print_table() -> None:
    """The class list and key tables, from a fresh tf_keras run (Keras 3 side), as Python
    for ``trainer/save_backends/legacy/builtin.py`` (``ruff format`` it)."""
    names, keras3_only, keras2_only = derive(_generate())
    lines = textwrap.wrap(" ".join(names), 84)
    print("_NAMES = (")
    print("\n".join(f'    "{line} "' for line in lines[:-1]) + f'\n    "{lines[-1]}"\n)')
    print("KERAS2_LAYERS = frozenset(_NAMES.split())")
    for title, table in (("KERAS3_ONLY_KEYS", keras3_only), ("KERAS2_ONLY_KEYS", keras2_only)):
        print(f"{title}: dict[str, tuple[str, ...]] = {{")
        for name, keys in table.items():
            items = ", ".join(json.dumps(key) for key in keys) + ("," if len(keys) == 1 else "")
            print(f"    {json.dumps(name)}: ({items}),")
        print("}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print_table()
    else:
        write_configs(sys.argv[1])
