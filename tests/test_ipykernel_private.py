"""Each private ipykernel API nbfsdp relies on (``nbfsdp.ui.ipykernel_private``), called in a real kernel.

An ipykernel release that moves one fails here, by name; tests/test_dashboard.py shows what they are
for (a toggle clicked while a cell runs acts on the ranks).
"""

from __future__ import annotations

import pytest

from tests.test_kernel import Kernel

pytestmark = [pytest.mark.floor, pytest.mark.timeout(120)]

IN_THE_KERNEL = """
import ipykernel, ipywidgets
from IPython import get_ipython
from nbfsdp.ui import ipykernel_private, widget_events

kernel = get_ipython().kernel
if ipykernel_private.has_subshells(kernel):
    subshell = ipykernel_private.create_subshell(kernel)
    button = ipywidgets.Button()
    before = button.comm._reply_subshell_for(None, None)  # the route ipykernel consults for each message
    ipykernel_private.route_comm_to_subshell(button.comm, subshell)
    after = button.comm._reply_subshell_for(None, None)
    print(repr((ipykernel.__version__, True, subshell, before, after)))
else:  # ipykernel 6: the private calls are never made; widget events are polled from inside the cell
    with widget_events.pending_events() as poll:
        poll()
    print(repr((ipykernel.__version__, False, poll is not None, None, None)))
"""


def test_subshell_created_and_a_comm_routed_to_it():
    kernel = Kernel()
    try:
        reply, messages = kernel.execute(IN_THE_KERNEL)
        assert reply["content"]["status"] == "ok", reply["content"]
        version, has_subshells, subshell, before, after = eval(kernel.stdout(messages))
    finally:
        kernel.shutdown()
    assert has_subshells is (int(version.split(".")[0]) >= 7)  # subshells came with ipykernel 7
    if has_subshells:
        assert isinstance(subshell, str) and subshell
        assert before != subshell and after == subshell
    else:
        assert subshell is True  # jupyter-ui-poll's poll, the fallback, is what the cell gets
