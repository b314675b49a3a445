"""Planning, in the notebook's kernel: the FSDP plan ``%fsdp explain`` prints, the plain FSDP2 code, the
predicted peak per rank (a traced step on the meta device) and whether it fits a GPU.
"""
