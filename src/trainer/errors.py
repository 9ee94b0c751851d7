"""Every error the project raises on purpose, in one hierarchy.

The CLI turns any ``TrainerError`` into a one-line message and exit code 2; anything else
is a bug. Messages say what is wrong, where, what to do, and end with what was received.

Where Keras raises a built-in type for the same situation (``TypeError`` for a class it
cannot locate or cannot rebuild from its config, ``ValueError`` for a lambda refused in safe
mode, for a model that is not built, or for a layer failing to load its state), the trainer
error is also of that type, so code written against ``keras.saving`` (``except ValueError``)
keeps working when it switches to a trainer backend.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of all deliberate trainer errors."""


class UnknownBackendError(TrainerError, KeyError):
    """A save backend name that is not registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(UnknownBackendError, ImportError):
    """A registered save backend (by name or entry point) whose class cannot be imported or
    is not a ``SaveBackend``; also an ``ImportError``, as the failed import is."""


class NotACheckpointError(TrainerError):
    """The path does not exist or holds nothing any backend recognises."""


class CorruptCheckpointError(TrainerError):
    """The path looks like a checkpoint but its content is damaged or inconsistent."""


class IntegrityError(CorruptCheckpointError):
    """A file of a checkpoint differs from its manifest (missing, resized, other digest).

    ``path`` is the checkpoint and ``file`` the first bad file, relative to it.
    """

    def __init__(self, message: str, *, path: object = None, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class IncompatibleFormatError(TrainerError):
    """The checkpoint was written in a format version this trainer cannot read."""


class MissingClassError(TrainerError, TypeError):
    """A class named in the checkpoint cannot be found and may not be revived otherwise."""


class RebuildError(TrainerError, TypeError):
    """A class the checkpoint names was found, but its own code cannot rebuild it from the
    config it saved (no ``from_config``, or its ``from_config`` / constructor / ``build`` /
    ``call`` / ``compile_from_config`` raised): the class is at fault, not the file. Keras
    raises ``TypeError`` for such a class."""


class UnsafeCheckpointError(MissingClassError, ValueError):
    """The checkpoint asks to run stored Python code (a marshalled lambda) in safe mode.

    ``problem`` says where the code is, without the advice, and ``received`` is Keras's
    refusal: a caller with other means than ``safe_mode=False`` (the CLI has none) words
    its own advice from them."""

    def __init__(self, message: str, *, problem: str = "", received: str = ""):
        super().__init__(message)
        self.problem = problem or message
        self.received = received


class ConfigError(TrainerError, ValueError):
    """A setting of the run's config cannot work; raised before training starts."""


class DataError(ConfigError):
    """The training data cannot be trained on as it is (NaN or infinite features, labels
    that are no class ids); raised when the data is loaded, before training starts."""


class TrainingDivergedError(TrainerError):
    """The loss became NaN or infinite: no checkpoint is written from such weights, and the
    run stops instead of letting retention replace the finite checkpoints with them."""


class ConfigMismatchError(TrainerError):
    """The run's config disagrees with the checkpoint it should resume from."""


class ModelNotReadyError(TrainerError, ValueError):
    """The model cannot be saved as it is (never built, or holds unserializable objects)."""


class RevivedCallError(TrainerError, ValueError):
    """A layer revived from traced functions was called with arguments none of its traces
    takes (a ``ValueError``, as the raw TensorFlow error it replaces)."""


class LayerStateError(TrainerError, ValueError):
    """A layer's own ``save_own_variables`` / ``load_own_variables`` / ``save_assets`` /
    ``load_assets`` raised: the layer's code failed, not the checkpoint."""


class UnsupportedLocationError(TrainerError, ValueError):
    """A location is a URL (``s3://``, ``gs://``...) of a storage trainer cannot use: it
    reads and writes this machine's filesystem only, and a URL must never be taken for a
    local folder of the same name."""


class StoreError(TrainerError, OSError):
    """An object-storage operation failed (missing bucket, refused credentials, unreachable
    endpoint...): one line saying which and where; also an ``OSError``, as the I/O failure
    it stands for."""


class DirectoryInUseError(TrainerError):
    """Another live process writes the run (or checkpoint) directory."""


class PeerWorkerError(TrainerError):
    """Another worker of a multi-worker run stopped before training (its own error is in
    its log), so this one stops too instead of waiting for it in a collective."""


class SaveError(TrainerError):
    """Writing a checkpoint failed; the previous checkpoints are intact."""


class SaveIOError(SaveError, OSError):
    """Writing a checkpoint failed in the operating system (also an ``OSError``, so code
    that catches I/O errors keeps working); ``errno`` is the original one, if any."""


class DiskFullError(SaveIOError):
    """The save ran out of space (ENOSPC, EDQUOT) or hit a file-size limit (EFBIG)."""


class SavePermissionError(SaveIOError):
    """The save was not allowed to write (EACCES, EPERM, EROFS)."""


class TensorBoardWriteError(SaveError):
    """A TensorBoard write of a run (scalars, a card, hparams, the graph) failed under
    ``checkpoint.policy.on_save_error=raise``; the checkpoints are not affected."""


class TensorBoardLinkError(TrainerError):
    """A checkpoint's or export's TensorBoard link does not lead to an event file holding
    its step (the run directory moved, or the event file was deleted)."""


class ExportError(TrainerError):
    """A serving export could not be written as asked; earlier versions are untouched."""


class UnsupportedLegacyError(TrainerError, ValueError):
    """A legacy tf.keras SavedModel uses something that cannot be imported into Keras 3
    with the same behaviour (a subclassed model, an option Keras 3 lacks); it names the
    layer and the reason instead of returning a model that computes something else."""
