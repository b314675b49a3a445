"""Runs on the engines, the ranks: the process group, the cell's namespace, FSDP2's application, live
changes at a step boundary, metrics, progress bars, this rank's part of a DataLoader.

May import ``nbfsdp.shared`` and the package root ``nbfsdp`` (the cell's ``log``, loaded lazily): nothing from
the kernel's side (no IPython errors, no ipyparallel client, no widgets), so that what a rank runs is read here
alone.
"""
