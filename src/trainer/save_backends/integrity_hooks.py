"""The manifest side of the backend contract: where a backend keeps its manifest, how a
finished checkpoint is sealed and how a load checks it.

A mixin of ``SaveBackend`` so that the hooks stay overridable one by one (a single-file
backend that embeds its manifest overrides ``check_integrity``) while ``base`` keeps the
save / load protocol itself readable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from trainer.save_backends.naming import class_path
from trainer.storage import integrity


class IntegrityHooks:
    """Sealing and checking a checkpoint against its manifest (``trainer.storage.integrity``).

    Attributes:
        manifest_file: Where a directory checkpoint keeps its manifest; None: none.
        read_late: Files (``fnmatch`` patterns) ``_read`` reads only after
            ``integrity.await_digests()``: their digests are checked in a thread meanwhile.
    """

    name: ClassVar[str]
    format_version: ClassVar[int]
    is_directory: ClassVar[bool]
    # Manifest location inside a directory checkpoint (``trainer.storage.integrity``); None: none.
    manifest_file: ClassVar[str | None] = integrity.MANIFEST_FILE
    # Files (``fnmatch`` patterns, relative to a directory checkpoint) that ``_read`` reads
    # only after calling ``integrity.await_digests()``: their digests are checked in a
    # thread while it rebuilds the model from the rest. Any other file is checked first.
    read_late: ClassVar[tuple[str, ...]] = ()

    def integrity_record(self) -> dict[str, Any] | None:
        """Where this backend keeps its manifest; stored in the metadata so that a
        checkpoint whose manifest was removed is detected.

        Returns:
            The manifest's file name and digest algorithm, or None: no manifest.
        """
        if not (self.is_directory and self.manifest_file):
            return None
        return {"manifest": self.manifest_file, "algorithm": integrity.ALGORITHM}

    def seal(self, tmp: Path, known: integrity.Known | None = None) -> None:
        """Write the manifest of a finished directory checkpoint, before its rename.

        Args:
            tmp: The temporary directory the checkpoint was written into.
            known: What ``_write`` returned: sizes and digests it need not read back.
        """
        if self.is_directory and self.manifest_file:
            integrity.write_manifest(
                tmp,
                self.manifest_file,
                known,
                backend=self.name,
                backend_class=class_path(type(self)),  # named in errors, never imported
                format_version=self.format_version,
            )

    def check_for_load(
        self, path: Path, *, verify: bool
    ) -> tuple[dict[str, Any] | None, integrity.DigestCheck]:
        """What ``load`` checks before ``_read``.

        Args:
            path: The checkpoint.
            verify: Check digests too, not only sizes.

        Returns:
            The manifest (None: the checkpoint has none) and the check of the digests of
            the ``read_late`` files, still being computed while the load reads them.

        Raises:
            IntegrityError: A file is missing, of another size or (``verify``) digest.
        """
        if verify and self.is_directory and self.manifest_file:
            return integrity.check_for_load(path, self.manifest_file, self.read_late)
        return self.check_integrity(path, digests=verify), integrity.NOTHING_PENDING

    def check_integrity(
        self, path: Path, *, digests: bool, strict: bool = False
    ) -> dict[str, Any] | None:
        """Check files against the manifest (sizes; digests and unlisted files on request).

        Single-file backends that embed a manifest override this.

        Args:
            path: The checkpoint.
            digests: Check SHA-256 digests too.
            strict: Also refuse files the manifest does not list.

        Returns:
            The manifest, or None if the checkpoint has none.

        Raises:
            IntegrityError: A file is missing, of another size or digest, or unlisted
                (``strict``).
        """
        if self.is_directory and self.manifest_file:
            return integrity.verify_directory(
                path, self.manifest_file, digests=digests, strict=strict
            )
        return None
