"""Limits and defaults every side checks the same way (the magics, checkpoint loads, the panel's controls,
``NBFSDP_PREWARM``)."""

#: The largest world nbfsdp starts on one machine (one engine process each).
MAX_WORLD_SIZE = 64
#: ``--timeout``'s default: the seconds a collective may wait before it fails, where nothing else says.
DEFAULT_TIMEOUT_SECONDS = 30.0
#: How long a new world's ranks wait for each other to join it, whatever ``--timeout`` says for its collectives: a
#: rank still starting on a busy machine is late, not hung (as long as the kernel waits for a world's set-up).
JOIN_TIMEOUT_SECONDS = 120.0


def world_size_error(world_size: int) -> str | None:
    """Why ``world_size`` cannot be a world's size, or None where it can."""
    if 1 <= world_size <= MAX_WORLD_SIZE:
        return None
    return f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}"
