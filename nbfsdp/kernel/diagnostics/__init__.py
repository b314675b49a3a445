"""Diagnostics, in the notebook's kernel: what nbfsdp says of a cell before, while and after it goes wrong. The
check of its code before its first step and ``%fsdp check`` (``check``, its rule families in ``rank_branches``,
``model_rules``, ``optimizer_rules`` and ``accumulation``, over the cell read by ``cell_code``); where the ranks
are while it runs and which rank left the others waiting (``where``), reported by itself once a rank waits too
long (``hang_report``); and a rank's out-of-memory report (``out_of_memory``). It leans on the planner and the
cluster below it; the cell's run above it calls it.
"""
