"""Limits every side checks the same way (the magics, the panel's controls, ``NBFSDP_PREWARM``)."""

#: The largest world nbfsdp starts on one machine (one engine process each).
MAX_WORLD_SIZE = 64
