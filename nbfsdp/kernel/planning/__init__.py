"""Planning, in the notebook's kernel: the FSDP plan ``%fsdp explain`` prints (``plans``) and its plain FSDP2 code
(``fsdp_code``); each rank's peak in a training step, a recording of the step traced on the meta device
(``recording``, ``live_bytes``) replayed under the settings (``ledger``, ``peak``); whether it fits a GPU and the
settings that would (``fitting``); a running cell's predicted peak (``predicted``); and the check of a cell's
code before its first step (``check``, ``cell_code``).
"""
