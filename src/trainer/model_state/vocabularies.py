"""Refuse, at save time, a lookup vocabulary that Keras's vocabulary file cannot give back.

An adapted ``StringLookup`` / ``IntegerLookup`` / ``TextVectorization`` keeps its
vocabulary through ``save_assets``: one token per line in ``vocabulary.txt``, read back by
``load_assets`` with ``str.splitlines()`` and with trailing empty lines dropped. A token
holding a line break (``\\n``, ``\\r``, or any other separator ``splitlines`` knows, such as
U+2028) comes back as two tokens, and an empty token at the end (missing values, when they
are the rarest) is lost: every later index shifts, and the load computes something else
without a word (Keras's own ``.keras`` the same). Every backend restores these layers
through those methods, so such a model is refused before anything is written. A vocabulary
given to the constructor (``vocabulary=[...]``) is stored in the config, exactly, and is
not concerned.
"""

from __future__ import annotations

from typing import Any

import keras

from trainer._compat import keras as keras_compat
from trainer.errors import ModelNotReadyError


def refuse_unstorable_vocabularies(model: keras.Model) -> None:
    for layer in keras_compat.sublayers(model, include_self=True):
        problem = unstorable_token(layer)
        if problem is not None:
            position, token, why = problem
            raise ModelNotReadyError(
                f"Layer {layer.name!r} ({type(layer).__name__}) has a vocabulary that Keras's "
                f"vocabulary file cannot give back: token {position} {why}, so a load would "
                f"shift every index after it and compute something else. Replace such tokens "
                f"in the data before adapt() (e.g. map '' to '[EMPTY]', strip line breaks), or "
                f"pass the vocabulary to the constructor (vocabulary=[...]), which the config "
                f"stores exactly. Received token {token!r}"
            )


def unstorable_token(layer: keras.layers.Layer) -> tuple[int, Any, str] | None:
    """(position, token, why) of the first token of ``layer``'s vocabulary file that
    ``load_assets`` would not read back as it is; None if all are, or if the layer keeps
    no vocabulary file (not a lookup layer, or its vocabulary is in its config)."""
    if not (hasattr(layer, "get_vocabulary") and hasattr(layer, "save_assets")):
        return None
    if _vocabulary_in_config(layer):
        return None
    words = [str(w) for w in layer.get_vocabulary(include_special_tokens=True)]
    if len("\n".join(words).splitlines()) != len(words):  # C-speed test of all of them
        for position, word in enumerate(words):
            if word.splitlines() != [word] and word:
                return position, word, "holds a line break"
    if words and words[-1] == "":
        return len(words) - 1, "", "is empty and last, and trailing empty lines are dropped"
    return None


def _vocabulary_in_config(layer: keras.layers.Layer) -> bool:
    try:
        return layer.get_config().get("vocabulary") is not None
    except Exception:
        return False
