"""Processes nbfsdp starts beside the cluster, each the entry point of its own process: the engines' fork
server, the reaper that ends a dead kernel's cluster, and the worker that draws the dashboards.

May import ``nbfsdp.shared`` only. The kernel's handles on them are ``nbfsdp.kernel.cluster.forkserver``,
``nbfsdp.kernel.cluster.reaping`` and ``nbfsdp.ui.renderer``.
"""
