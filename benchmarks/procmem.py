"""A process's resident memory and its peak, from ``/proc`` (Linux).

``reset_peak(pid)`` writes 5 to ``/proc/PID/clear_refs``, which sets the peak (``VmHWM``) back to the current
resident size (``VmRSS``); ``read(pid)`` returns both in bytes.
"""

from __future__ import annotations

from pathlib import Path


def read(pid: int) -> dict[str, int]:
    """``{"rss": VmRSS, "hwm": VmHWM}`` in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key.removeprefix("Vm").lower()] = int(rest.split()[0]) * 1024
    return values


def reset_peak(pid: int) -> int:
    """Reset the peak to the resident size now; that size in bytes (the baseline)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return read(pid)["rss"]


def available() -> bool:
    import os

    try:
        reset_peak(os.getpid())
    except OSError:
        return False
    return True
