"""Runs in the notebook's kernel, drawn by the frontend: the dashboard, the settings controls, the panel,
and how widget events reach the kernel while a cell blocks it.

May import ``nbfsdp.shared`` and ``nbfsdp.helpers`` (the drawing worker the dashboard hands its figures); never
``nbfsdp.kernel`` (which drives these widgets) or ``nbfsdp.engines``.
"""
