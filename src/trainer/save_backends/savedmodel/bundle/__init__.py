"""trainer's own writer of TensorFlow's tensor-bundle checkpoint (``variables/``) and its
SaverDef: repeat saves without TensorFlow's ``SaveV2`` walk."""
