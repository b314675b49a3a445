"""nbfsdp's benchmarks: ``make bench`` (``python -m benchmarks``); see ``benchmarks/__main__.py``."""
