"""The save path of a trainer SavedModel: trace the model into a ``tf.Module`` tree, its
serving endpoints, and trace once for many saves."""
