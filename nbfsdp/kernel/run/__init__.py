"""A cell's run, in the notebook's kernel: the session that turns a ``%%fsdp`` cell into named steps (``session``),
its inputs and spec (``inputs``, ``spec``), the models' delivery (``delivery``) and what the engines already hold
(``held``), where a model's weights live and their gathering on demand (``residence``, ``gathering``), loaders,
the ranks watched (``runner``) and steered (``control``), the submitted cell's results (``cell_run``), history,
and what a stuck or failed cell reports (``where``, ``hang_report``, ``out_of_memory``). A call on every rank,
which each of them waits on, is ``nbfsdp.kernel.cluster.rank_calls``.
"""
