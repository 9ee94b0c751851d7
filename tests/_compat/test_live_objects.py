"""Attributes on live Keras objects go through ``trainer._compat.live_objects`` (issue 37).

Everything trainer stores on a Keras object, and every method it replaces on one, goes
through that module's declared markers and helpers: a scan of ``src/trainer`` refuses
``object.__setattr__`` / ``object.__delattr__`` and marker names (``_trainer_...``)
spelled out anywhere outside ``_compat/``, and every declared marker must be used.

Names of the form ``__trainer_...__`` are not markers: they are keys and tokens written
into saved files (a config placeholder, class-name tokens, a keyword argument of traced
functions), never attributes of live objects, so the scan leaves them alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import pytest

from tests.helpers.paths import ROOT
from trainer._compat import live_objects

PACKAGE = ROOT / "src" / "trainer"
DECLARING_MODULE = PACKAGE / "_compat" / "live_objects.py"
FORBIDDEN = {
    "object.__setattr__/__delattr__ (use trainer._compat.live_objects)": re.compile(
        r"object\.__(?:set|del)attr__\("
    ),
    # A marker name, not a ``__trainer_...__`` key of a saved file (preceded by a word char).
    "a marker name (declare it in trainer._compat.live_objects)": re.compile(r"(?<!\w)_trainer_"),
}


def offences(package: Path) -> list[str]:
    """``path:line: what`` for every forbidden text in ``package`` outside ``_compat/``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "_compat" in path.relative_to(package).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(package)}:{number}: {what}: {line.strip()}")
    return found


def declared() -> dict[str, str]:
    """The declared markers: constant name -> attribute name."""
    return {
        name: value
        for name, value in vars(live_objects).items()
        if name.isupper() and isinstance(value, str) and value in live_objects.MARKERS
    }


def test_no_marker_or_object_setattr_outside_compat():
    assert offences(PACKAGE) == []


def test_the_scan_fails_on_planted_lines(tmp_path):
    (tmp_path / "_compat").mkdir()
    (tmp_path / "_compat" / "allowed.py").write_text('object.__setattr__(x, "_trainer_a", 1)\n')
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "planted.py").write_text(
        'KEY = "__trainer_saved_key__"\n'  # a key of a saved file: allowed
        'object.__setattr__(layer, "states", [])\n'
        'value = getattr(layer, "_trainer_original", None)\n'
        "object.__delattr__(layer, 'call')\n"
    )
    found = offences(tmp_path)
    assert [entry.split(":")[1] for entry in found] == ["2", "3", "4"], found
    assert all(entry.startswith(str(Path("models", "planted.py"))) for entry in found)


def test_every_declared_marker_is_used_and_described():
    markers = declared()
    assert set(markers.values()) == live_objects.MARKERS
    assert len(set(markers.values())) == len(markers), "two names for one marker"
    others = [p.read_text() for p in PACKAGE.rglob("*.py") if p != DECLARING_MODULE]
    unused = [n for n in markers if not any(re.search(rf"\b{n}\b", t) for t in others)]
    assert unused == [], f"declared in live_objects but used nowhere: {unused}"
    lines = DECLARING_MODULE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"[A-Z_]+ = \"_trainer_", line):
            assert lines[number - 1].startswith("# "), f"no comment above: {line}"


def test_the_attribute_names_are_those_trainer_always_set():
    """Tests and user code read these names on revived layers: renaming one is a change
    of behaviour, not a refactoring."""
    always = """_trainer_revived_from _trainer_original _trainer_call_infer _trainer_call_train
        _trainer_training_traced _trainer_python_gradient _trainer_signature
        _trainer_opaque_defaults _trainer_compute_mask _trainer_takes_masks
        _trainer_input_structure _trainer_frozen_flags _trainer_loaded _trainer_input_names
        _trainer_input_dtypes _trainer_legacy_revived _trainer_function _trainer_extra
        _trainer_config _trainer_regularizers _trainer_call_default"""
    assert set(always.split()) == live_objects.MARKERS


def test_set_marker_bypasses_keras_tracking():
    layer = keras.layers.Dense(2)
    variable = keras.Variable(1.0)
    live_objects.set_marker(layer, live_objects.LEGACY_REGULARIZERS, [variable])
    layer.tracked = []  # what Keras does with a plain assignment: tracks it
    assert type(vars(layer)["tracked"]) is not list
    assert type(vars(layer)[live_objects.LEGACY_REGULARIZERS]) is list
    layer.build((None, 3))
    assert not any(w is variable for w in layer.weights)
    assert live_objects.get_marker(layer, live_objects.LEGACY_REGULARIZERS) == [variable]


def test_markers_read_delete_and_refuse_undeclared_names():
    layer = keras.layers.Dense(2)
    assert live_objects.get_marker(layer, live_objects.LEGACY_REVIVED, False) is False
    live_objects.set_marker(layer, live_objects.LEGACY_REVIVED, True)
    assert layer._trainer_legacy_revived is True  # the name stored as before
    live_objects.delete_marker(layer, live_objects.LEGACY_REVIVED)
    live_objects.delete_marker(layer, live_objects.LEGACY_REVIVED)  # none: nothing happens
    assert live_objects.get_marker(layer, live_objects.LEGACY_REVIVED) is None
    with pytest.raises(ValueError, match="not a marker declared"):
        live_objects.set_marker(layer, "_trainer_undeclared", 1)

    class Standin:
        pass

    live_objects.set_marker(Standin, live_objects.REVIVED_FROM, "somewhere")
    assert live_objects.get_marker(Standin(), live_objects.REVIVED_FROM) == "somewhere"


def test_patch_method_restores_what_was_there():
    layer, class_method = keras.layers.Dense(2), keras.layers.Dense.get_config
    restore = live_objects.patch_method(layer, "get_config", lambda: {"patched": True})
    assert layer.get_config() == {"patched": True}
    assert "get_config" in vars(layer) and keras.layers.Dense.get_config is class_method
    assert keras.layers.Dense(3).get_config()["units"] == 3  # other instances untouched
    restore()
    assert "get_config" not in vars(layer) and layer.get_config()["units"] == 2

    first = live_objects.patch_method(layer, "call", lambda x: "first")
    second = live_objects.patch_method(layer, "call", lambda x: "second")
    assert layer.call(None) == "second"
    second()
    assert layer.call(None) == "first"
    first()
    assert "call" not in vars(layer)

    class Plain:
        def method(self):
            return "class"

    restore = live_objects.patch_method(Plain, "method", lambda self: "patched")
    assert Plain().method() == "patched"
    restore()
    assert Plain().method() == "class"


def test_patch_method_of_a_special_method_uses_a_subclass_for_one_instance():
    layer, other = keras.layers.Dense(2), keras.layers.Dense(2)
    seen = []

    def recording(instance, *args, **kwargs):
        seen.append(instance)
        return keras.layers.Dense.__call__(instance, *args, **kwargs)

    restore = live_objects.patch_method(layer, "__call__", recording)
    assert type(layer).__name__ == "Dense" and type(layer) is not keras.layers.Dense
    layer(keras.ops.ones((1, 3)))
    other(keras.ops.ones((1, 3)))
    assert seen == [layer]
    restore()
    assert type(layer) is keras.layers.Dense
