"""The SaverDef of a savedmodel save, written by trainer rather than by TensorFlow.

Why: a SavedModel's ``MetaGraphDef.saver_def`` names a restore op (and a save op) in its
graph. TF Serving, the C++ ``LoadSavedModel`` and TF1's ``loader.load`` (what
``saved_model_cli run`` uses) run that op to give the variables their values; without it
they serve uninitialized variables. ``tf.saved_model.save`` builds it by tracing two
functions over every variable, model and optimizer slots: on the benchmark models it was
28 % of a first save, 1.4 s of 3.5 s on the 800-variable one (issue 17). The ops it needs
are few and always the same, so they are written here as plain graph nodes, the way TF1's
``Saver`` wrote them:

- ``saver_filename``: the checkpoint prefix the caller feeds;
- restore: one ``RestoreV2`` of every variable's checkpoint key, one ``AssignVariableOp``
  per variable into its handle node, grouped by a ``NoOp``;
- save: one ``ReadVariableOp`` per variable and one ``SaveV2`` writing the same keys and
  the object graph (the checkpoint TF2's own saver writes), then the prefix back.

Each key is paired with its variable by the variables writer (walking the checkpoint's
object graph from the traced root), and each variable with its handle node by the save
itself (``_compat.tensorflow.exported_variable_handles``): names, never guesses. A save
where any checkpoint entry is not a plain variable reached that way returns False here,
and the caller saves again with TensorFlow's own saver.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2
from tensorflow.core.protobuf import saved_model_pb2, saver_pb2

from trainer._compat import tensorflow as tf_compat
from trainer.save_backends.savedmodel.bundle.variables_writer import VariablesWriter

FILENAME = "saver_filename"
SCOPE = "trainer_saver/"
CPU = "/device:CPU:0"
OPS = ["AssignVariableOp", "Const", "Identity", "NoOp", "Placeholder", "ReadVariableOp"]
OPS += ["RestoreV2", "SaveV2"]


def add_saver(directory: Path, writer: VariablesWriter, handles: dict[int, str]) -> bool:
    """Add the SaverDef and its nodes to ``directory/saved_model.pb`` (written without
    one), over the keys and variables ``writer`` writes; False, and nothing changed, if a
    variable's handle node is unknown or the graph already uses the names."""
    keys, variables = writer.keys, writer.variables
    nodes = [handles.get(id(v)) for v in variables]
    if None in nodes:
        return False
    path = directory / "saved_model.pb"
    model = saved_model_pb2.SavedModel.FromString(path.read_bytes())
    meta_graph = model.meta_graphs[0]
    taken = {node.name for node in meta_graph.graph_def.node}
    if FILENAME in taken or any(name.startswith(SCOPE) for name in taken):
        return False
    dtypes = [v.dtype.as_datatype_enum for v in variables]
    graph = meta_graph.graph_def
    _placeholder(graph)
    restore_op = _restore(graph, keys, nodes, dtypes)
    save_tensor = _save(graph, keys, nodes, dtypes, writer.object_graph)
    meta_graph.saver_def.CopyFrom(
        saver_pb2.SaverDef(
            filename_tensor_name=f"{FILENAME}:0",
            save_tensor_name=save_tensor,
            restore_op_name=restore_op,
            version=saver_pb2.SaverDef.V2,
        )
    )
    listed = {op.name for op in meta_graph.meta_info_def.stripped_op_list.op}
    missing = [name for name in OPS if name not in listed]
    meta_graph.meta_info_def.stripped_op_list.op.extend(tf_compat.op_defs(missing))
    path.write_bytes(model.SerializeToString())
    return True


def _node(graph, name: str, op: str, inputs: list[str], device: str = "", **attrs):
    node = graph.node.add(name=name, op=op, device=device)
    node.input.extend(inputs)
    for key, value in attrs.items():
        node.attr[key].CopyFrom(value)
    return node


def _type(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def _types(dtypes: list[int]) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=dtypes))


def _strings(graph, name: str, values: list[str] | bytes) -> str:
    array = np.array(values, dtype=object)
    tensor = tf.make_tensor_proto(array, dtype=tf.string)
    value = attr_value_pb2.AttrValue(tensor=tensor)
    _node(graph, name, "Const", [], CPU, dtype=_type(tf.string.as_datatype_enum), value=value)
    return name


def _placeholder(graph) -> None:
    scalar = attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto())
    _node(graph, FILENAME, "Placeholder", [], dtype=_type(tf.string.as_datatype_enum), shape=scalar)


def _restore(graph, keys: list[str], nodes: list[str], dtypes: list[int]) -> str:
    names = _strings(graph, f"{SCOPE}restore_keys", keys)
    slices = _strings(graph, f"{SCOPE}restore_slices", [""] * len(keys))
    restore = f"{SCOPE}RestoreV2"
    _node(graph, restore, "RestoreV2", [FILENAME, names, slices], CPU, dtypes=_types(dtypes))
    no_shape_check = attr_value_pb2.AttrValue(b=False)
    assigns = []
    for index, (handle, dtype) in enumerate(zip(nodes, dtypes, strict=True)):
        name = f"{SCOPE}assign_{index}"
        inputs = [handle, f"{restore}:{index}"]
        _node(
            graph,
            name,
            "AssignVariableOp",
            inputs,
            dtype=_type(dtype),
            validate_shape=no_shape_check,
        )
        assigns.append(f"^{name}")
    _node(graph, f"{SCOPE}restore_all", "NoOp", assigns)
    return f"{SCOPE}restore_all"


def _save(graph, keys: list[str], nodes: list[str], dtypes: list[int], object_graph: bytes) -> str:
    names = _strings(graph, f"{SCOPE}save_keys", [tf_compat.OBJECT_GRAPH_KEY, *keys])
    slices = _strings(graph, f"{SCOPE}save_slices", [""] * (len(keys) + 1))
    objects = _strings(graph, f"{SCOPE}object_graph", object_graph)
    reads = []
    for index, (handle, dtype) in enumerate(zip(nodes, dtypes, strict=True)):
        name = f"{SCOPE}read_{index}"
        _node(graph, name, "ReadVariableOp", [handle], dtype=_type(dtype))
        reads.append(name)
    string = tf.string.as_datatype_enum
    _node(
        graph, f"{SCOPE}SaveV2", "SaveV2", [FILENAME, names, slices, objects, *reads], CPU,
        dtypes=_types([string, *dtypes]),
    )  # fmt: skip
    inputs = [FILENAME, f"^{SCOPE}SaveV2"]
    _node(graph, f"{SCOPE}saved", "Identity", inputs, CPU, T=_type(string))
    return f"{SCOPE}saved:0"
