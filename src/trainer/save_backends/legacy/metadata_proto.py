"""Our own protobuf definition of tf.keras' ``keras_metadata.pb``.

The legacy format's metadata file is a ``SavedMetadata`` message: one ``SavedObject`` per
Keras object of the SavedModel's object graph (``node_id`` is its node there, ``node_path``
how it is reached from the root, ``identifier`` its kind such as ``_tf_keras_layer`` and
``metadata`` a JSON string with its class name, config and build shape). The layout is
public; it is declared here with ``descriptor_pb2`` so that reading it needs neither
``tf_keras`` nor TensorFlow's private modules. Field numbers were checked against files
written by tf_keras 2.21 (tests/children/legacy_fixtures.py).
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "trainer.legacy_keras"
_F = descriptor_pb2.FieldDescriptorProto


def _field(message, name, number, kind, *, repeated=False, type_name=None) -> None:
    field = message.field.add()
    field.name = name
    field.number = number
    field.type = kind
    field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if type_name:
        field.type_name = f".{_PACKAGE}.{type_name}"


def _file() -> descriptor_pb2.FileDescriptorProto:
    """VersionDef{producer=1, min_consumer=2, bad_consumers=3};
    SavedObject{node_id=2, node_path=3, identifier=4, metadata=5, version=6}
    (field 1 is unused by tf.keras); SavedMetadata{nodes=1}."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="trainer_legacy_keras_metadata.proto", package=_PACKAGE, syntax="proto3"
    )
    version = proto.message_type.add(name="VersionDef")
    _field(version, "producer", 1, _F.TYPE_INT32)
    _field(version, "min_consumer", 2, _F.TYPE_INT32)
    _field(version, "bad_consumers", 3, _F.TYPE_INT32, repeated=True)
    saved = proto.message_type.add(name="SavedObject")
    _field(saved, "node_id", 2, _F.TYPE_INT32)
    _field(saved, "node_path", 3, _F.TYPE_STRING)
    _field(saved, "identifier", 4, _F.TYPE_STRING)
    _field(saved, "metadata", 5, _F.TYPE_STRING)
    _field(saved, "version", 6, _F.TYPE_MESSAGE, type_name="VersionDef")
    root = proto.message_type.add(name="SavedMetadata")
    _field(root, "nodes", 1, _F.TYPE_MESSAGE, repeated=True, type_name="SavedObject")
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
SavedMetadata = message_factory.GetMessageClass(
    _POOL.FindMessageTypeByName(f"{_PACKAGE}.SavedMetadata")
)
SavedObject = message_factory.GetMessageClass(
    _POOL.FindMessageTypeByName(f"{_PACKAGE}.SavedObject")
)
