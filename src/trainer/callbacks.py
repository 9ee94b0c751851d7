"""The Keras callbacks trainer gives its users: put them in ``model.fit`` or in ``conf/callbacks``.

* ``Checkpoint``: saves through any save backend when the policy says, and resumes a re-run
  script (``resume="auto"``); see ``trainer.checkpointing``.
* ``CSVLogger``: ``keras.callbacks.CSVLogger`` whose rows follow the checkpoints of a run
  (``conf/callbacks/csv_logger.yaml``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import keras

from trainer.checkpointing.keras_callback import Checkpoint
from trainer.errors import CorruptCheckpointError
from trainer.state import is_count
from trainer.storage.atomic import first_unused

__all__ = ["CSVLogger", "Checkpoint"]

log = logging.getLogger(__name__)


class CSVLogger(keras.callbacks.CSVLogger):
    """``keras.callbacks.CSVLogger`` for runs whose rows follow the checkpoints.

    A relative ``filename`` lives in the run directory (``train(cfg)``), and a resumed run
    drops the rows logged after its checkpoint (a crash between the row and the checkpoint
    would otherwise log those epochs twice). Its state (``state_dict``) is saved with every
    checkpoint.

    Args:
        filename: The CSV file; relative: inside the run directory.
        separator: The column separator.
        append: Append to an existing file (a resumed run does); ``False`` empties it when
            training begins.
    """

    def __init__(self, filename: str = "metrics.csv", separator: str = ",", append: bool = True):
        super().__init__(filename, separator=separator, append=append)
        self.rows = 0
        # With append=False Keras empties the file when training begins; a resumed session
        # keeps the rows its checkpoint counted from what the file held then.
        self._before: bytes | None = None

    def on_train_begin(self, logs=None):
        path = Path(self.filename)
        self._before = path.read_bytes() if not self.append and path.is_file() else None
        super().on_train_begin(logs)

    def set_run_dir(self, run_dir: Path) -> None:
        if not Path(self.filename).is_absolute():
            self.filename = str(Path(run_dir) / self.filename)
            self._in_run_dir = True

    _in_run_dir = False  # the file is the run's own (a relative filename)

    def start_afresh(self) -> None:
        """Start a new run's file again, moving rows an earlier session left aside.

        A new run (step 0) whose own file already holds rows: a session of this run directory
        that ended before its first checkpoint (a resume then starts anew) left them, and
        appended to, its epochs showed twice (0, 0, 1, 2). They are moved to
        ``<file>.abandoned-<n>`` beside it, nothing deleted, and the file starts again. A file
        outside the run directory (an absolute filename) is the user's: left as is.
        """
        path = Path(self.filename)
        if not (self._in_run_dir and self.append and path.is_file()):
            return
        content = path.read_bytes()
        if len(content.splitlines()) <= 1:
            return
        kept = first_unused(lambda n: path.with_name(f"{path.name}.abandoned-{n}"))
        with open(kept, "xb") as file:
            file.write(content)
        self._rewrite(b"")
        self.append_header = True
        log.warning("%s held rows of an earlier session; moved to %s", path, kept)

    def _rewrite(self, content: bytes) -> None:
        """Replace the file's content through the handle ``on_train_begin`` opened for
        appending (the rows written next follow ``content``)."""
        self.csv_file.seek(0)
        self.csv_file.truncate()
        self.csv_file.write(content.decode())
        self.csv_file.flush()

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.rows += 1

    def state_dict(self) -> dict[str, Any]:
        """The state saved with each checkpoint.

        Returns:
            ``{"rows": N}``: the rows logged up to this checkpoint.
        """
        return {"rows": self.rows}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a saved state ``load_state_dict`` cannot take.

        Checked when the run is built, before its session writes anything.

        Args:
            state: What ``state_dict`` returned when the checkpoint was saved.

        Raises:
            CorruptCheckpointError: ``rows`` is not a count.
        """
        if not is_count(state.get("rows", 0)):
            raise CorruptCheckpointError(
                f"The checkpoint's CSVLogger state is damaged: 'rows' must be a count of the "
                f"rows logged. Resume from another checkpoint. Received: {str(state)[:300]}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the header and the first ``rows`` rows of the file.

        Runs after ``on_train_begin`` opened the file for appending, so the file is rewritten
        through that handle.

        Args:
            state: What ``state_dict`` returned when the checkpoint was saved.

        Raises:
            CorruptCheckpointError: ``rows`` is not a count.
        """
        self.check_state_dict(state)
        self.rows = state.get("rows", 0)
        path = Path(self.filename)
        before, self._before = self._before, None
        if before is None and not path.is_file():
            return
        lines = (path.read_bytes() if before is None else before).splitlines(keepends=True)
        if before is None and len(lines) <= 1 + self.rows:
            return
        self._rewrite(b"".join(lines[: 1 + self.rows]))
        if self.rows and len(lines) > 1:
            self.append_header = False  # the kept header is the file's
