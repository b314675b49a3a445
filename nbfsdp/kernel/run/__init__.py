"""A cell's run, in the notebook's kernel: the session that turns a ``%%fsdp`` cell into a run, what the engines
hold, the models' delivery, loaders, live control, history and ``%fsdp where``. A call on every rank, which each
of them waits on, is ``nbfsdp.kernel.cluster.rank_calls``.
"""
