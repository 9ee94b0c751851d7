"""What a checkpoint directory holds, as tests list it."""

from __future__ import annotations

from pathlib import Path


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory`` (no temporaries, no ``latest`` pointer), by name."""
    return sorted(p for p in directory.iterdir() if p.name[0] != "." and p.name != "latest")
