"""``%%fsdp`` and ``%fsdp``: argument parsing only; the session does the work."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbfsdp.cluster import visible_gpus
from nbfsdp.session import Session

DEFAULT_TIMEOUT_SECONDS = 30.0
MAX_WORLD_SIZE = 64
LINE_ACTIONS = ("status", "stop")


@magics_class
class FSDPMagics(Magics):
    """Train the notebook's models sharded with FSDP2 across an ipyparallel cluster."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.session = Session(shell)

    @magic_arguments()
    @argument(
        "--world-size",
        "-n",
        type=int,
        default=None,
        help="Number of ranks, one engine each (default: the number of GPUs, or 2 on CPU).",
    )
    @argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"Seconds a collective may wait before it fails (default {DEFAULT_TIMEOUT_SECONDS:g}).",
    )
    @argument(
        "--no-gather",
        action="store_true",
        help="Leave the trained weights on the engines; the notebook's models keep their old weights.",
    )
    @cell_magic
    def fsdp(self, line: str, cell: str) -> None:
        """Run this cell on every rank, with the notebook's models sharded by FSDP2.

        Inside the cell ``rank``, ``world_size`` and ``device`` are defined and
        ``nbfsdp`` is imported; every name the cell reads comes from the
        notebook. Afterwards the notebook's models hold the trained weights and
        the names the cell assigned hold rank 0's values.
        """
        args = parse_argstring(self.fsdp, line)
        world_size = args.world_size if args.world_size is not None else (visible_gpus() or 2)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
        if not args.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        self.session.run_cell(cell, world_size=world_size, timeout=args.timeout, gather=not args.no_gather)

    @magic_arguments()
    @argument("action", choices=LINE_ACTIONS, help="status: engines, ranks, devices, pids; stop: end the cluster.")
    @line_magic("fsdp")
    def fsdp_line(self, line: str) -> None:
        """Inspect or stop the cluster behind ``%%fsdp``."""
        args = parse_argstring(self.fsdp_line, line)
        if args.action == "stop":
            self.session.stop()
            print("nbfsdp: cluster stopped")
            return
        world = self.session.cluster.world
        if world is None:
            print("nbfsdp: no cluster running")
            return
        print(
            f"world size {world.world_size}, backend {world.backend}, collective timeout {world.timeout:g}s"
            f"{' (broken: restarts on the next cell)' if world.broken else ''}"
        )
        print(f"{'rank':>4}  {'engine':>6}  {'pid':>7}  {'threads':>7}  device")
        for rank, (engine_id, info) in enumerate(zip(world.engine_ids, world.engines, strict=True)):
            print(f"{rank:>4}  {engine_id:>6}  {info['pid']:>7}  {info['threads']:>7}  {info['device']}")

    def stop(self) -> None:
        self.session.stop()
