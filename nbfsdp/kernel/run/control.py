"""Steering a running cell from the notebook (the kernel's side): settings changes and cancel.

The ranks' side, which applies them, is ``nbfsdp.engines.control``.

The notebook writes the wanted live settings (and a cancel flag) to a request
file in the cluster's private directory; every rank looks at it, one ``stat``,
at each step boundary: the start of a forward of the cell's models
(``StepBoundaries``), or, in a cell without a model, each ``nbfsdp.log`` call.
A forward is the boundary because every rank runs the same forwards (their
collectives must match) whether it logs on every rank, on one, or never; a
change applied at a log call would switch only the ranks that log.

All ranks must switch at the same boundary, yet no collective may be added
there (it would hang or reorder the cell's own). So the ranks agree through
the file system: the first rank to see request version v at its boundary
``a`` claims boundary ``a + 1`` for it (``os.link`` is atomic and fails if
another rank claimed first), and every rank applies v at the claimed one.
A training step holds collectives, so no rank passes a whole boundary ahead
of another: a rank that first sees v at boundary ``b`` has ``b <= a + 1``.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from nbfsdp.shared.protocol import ControlRequest, control_file, control_files


class RunControl:
    """The notebook's side: what the running cell should switch to, versioned.

    ``unavailable``: why this run cannot be steered (ranks on hosts that do not see ``directory``); the
    ranks are then given no request file at all, and a change or cancel is refused with that reason."""

    def __init__(self, directory: str, run_id: int, unavailable: str | None = None) -> None:
        self.path = control_file(directory, run_id)
        self.unavailable = unavailable
        self.request = ControlRequest()
        self._publish()

    @property
    def for_ranks(self) -> str:
        """The request file the ranks look at, or '' for none."""
        return "" if self.unavailable else str(self.path)

    def change(self, settings: dict[str, Any]) -> None:
        """Ask every rank to switch to ``settings`` (live keys only) at the next step boundary."""
        self._steerable()
        self.request.settings.update(settings)
        self.request.version += 1
        self._publish()

    def cancel(self) -> None:
        """Ask every rank to end the cell cleanly at the next step boundary."""
        self._steerable()
        self.request.cancel = True
        self.request.version += 1
        self._publish()

    def _steerable(self) -> None:
        if self.unavailable:
            raise UsageError(self.unavailable)

    def _publish(self) -> None:
        """Atomically: a rank never reads half a request."""
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text(self.request.to_json())
        partial.replace(self.path)

    def remove(self) -> None:
        """The request file and its claims: the run is over."""
        for leftover in list(control_files(self.path)):
            leftover.unlink(missing_ok=True)
