"""Limits and defaults every side checks the same way (the magics, checkpoint loads, the panel's controls,
``NBFSDP_PREWARM``)."""

#: The largest world nbfsdp starts on one machine (one engine process each).
MAX_WORLD_SIZE = 64
#: ``--timeout``'s default: the seconds a collective may wait before it fails, where nothing else says.
DEFAULT_TIMEOUT_SECONDS = 30.0


def world_size_error(world_size: int) -> str | None:
    """Why ``world_size`` cannot be a world's size, or None where it can."""
    if 1 <= world_size <= MAX_WORLD_SIZE:
        return None
    return f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}"
