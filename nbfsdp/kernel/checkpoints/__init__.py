"""Checkpoints, in the notebook's kernel: sharded saves and loads on the ranks, export and import of full
weights, and the exported torchrun script.
"""
