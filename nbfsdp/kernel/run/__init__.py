"""A cell's run, in the notebook's kernel: the session that turns a ``%%fsdp`` cell into a run, what the engines
hold, the calls on every rank, the models' delivery, loaders, live control, history and ``%fsdp where``.
"""
