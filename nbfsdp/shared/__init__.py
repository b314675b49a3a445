"""Imported by more than one kind of process (the kernel, the engines, the helpers): FSDP settings and
their rules (config, units), the messages between kernel and engines (protocol), the pickling of names
and shard-only models (transfer), optimizers both ways, processes by pid and start time, the network,
the dashboard's figures, and PyTorch's private APIs.

May import no other nbfsdp subpackage, and nothing of IPython, ipykernel or ipyparallel.
"""
