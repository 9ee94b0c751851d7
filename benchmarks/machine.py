"""What the figures were measured on: CPU, cores, memory, disk, load and versions."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def disk(path: Path) -> str:
    """Device, filesystem and mount point holding ``path`` (from /proc/mounts)."""
    path = Path(path).resolve()
    best = None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype, *_ = line.split()
            if (path == Path(mount) or Path(mount) in path.parents) and (
                best is None or len(mount) > len(best[1])
            ):
                best = (device, mount, fstype)
    except OSError:
        pass
    if best is None:
        return "unknown"
    device, mount, fstype = best
    rotational = ""
    name = Path(device).name
    flag = Path(f"/sys/block/{name}/queue/rotational")
    if flag.exists():
        rotational = ", rotational" if flag.read_text().strip() == "1" else ", non-rotational"
    return f"{device} ({fstype}{rotational}) mounted at {mount}"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def describe(workdir: Path) -> dict[str, str]:
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": memory_gib(),
        "disk": disk(workdir),
        "workdir": str(workdir),
        "python": platform.python_version(),
        "tensorflow": version("tensorflow"),
        "keras": version("keras"),
        "tf_keras": version("tf-keras"),
        "load_before": load_average(),
    }
