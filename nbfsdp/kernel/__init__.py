"""Runs in the notebook's kernel: the magics, the session that turns a cell into a run, the cluster and
its clients, delivery of the models' shards, the run records, and the handles on the helper processes.

May import ``nbfsdp.shared``, ``nbfsdp.ui``, ``nbfsdp.helpers`` (the functions it hands those processes)
and ``nbfsdp.engines`` (the functions it runs on the ranks, named by reference). Imports torch and
ipyparallel lazily where it can: ``import nbfsdp`` stays light.
"""
