"""The live dashboard in a real kernel: figures redraw while the cell runs, and a PNG stays behind."""

from __future__ import annotations

import pytest

from tests.test_kernel import Kernel

pytestmark = pytest.mark.timeout(240)

TEN_SECONDS = """%%fsdp --world-size 2 --wrap-cls Linear
import time
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(50):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.execute("%load_ext nbfsdp\nimport torch, torch.nn as nn, nbfsdp")
    k.execute("model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))")
    reply, _ = k.execute("%%fsdp --world-size 2 --wrap-cls Linear\nmodel")  # a warm cluster, the model sharded
    assert reply["content"]["status"] == "ok"
    yield k
    k.shutdown()


def _figure_updates(messages: list) -> list[float]:
    """Arrival times of widget updates that carry a new figure."""
    return [
        at
        for at, msg in messages
        if msg["msg_type"] == "comm_msg"
        and msg["content"]["data"].get("method") == "update"
        and ["value"] in msg["content"]["data"].get("buffer_paths", [])  # an Image's PNG travels as a buffer
    ]


def test_figures_redraw_live_during_a_ten_second_cell(kernel):
    reply, messages = kernel.execute(TEN_SECONDS)
    assert reply["content"]["status"] == "ok"
    end = messages[-1][0]
    updates = _figure_updates(messages)
    assert end > 9
    assert len(updates) >= 5, updates
    assert updates[0] < 2.0  # first points within 2 s
    assert updates[-2] > end - 3  # still redrawing near the end, not only at the start
    # the widget is displayed before anything else, above the cell's own output
    first_display = next(m for _, m in messages if m["msg_type"] in ("display_data", "stream"))
    assert first_display["msg_type"] == "display_data"
    assert "application/vnd.jupyter.widget-view+json" in first_display["content"]["data"]


def test_a_static_png_stays_for_frontends_without_widgets(kernel):
    _, messages = kernel.execute(TEN_SECONDS.replace("range(50)", "range(3)"))
    final = [m for _, m in messages if m["msg_type"] == "update_display_data"][-1]["content"]["data"]
    assert final["image/png"] and "application/vnd.jupyter.widget-view+json" in final
    assert "3 ranks" not in final["text/plain"] and "records" in final["text/plain"]


def test_the_dashboard_keeps_working_after_a_failed_cell(kernel):
    reply, _ = kernel.execute("%%fsdp --world-size 2\nnbfsdp.log(step=0, loss=1.0)\nraise ValueError('x')")
    assert reply["content"]["status"] == "error"
    reply, messages = kernel.execute(TEN_SECONDS.replace("range(50)", "range(8)"))
    assert reply["content"]["status"] == "ok"
    assert _figure_updates(messages)


def test_compare_shows_the_table_and_overlaid_loss_curves(kernel):
    reply, messages = kernel.execute("%fsdp compare 2")
    assert reply["content"]["status"] == "ok"
    assert kernel.stdout(messages).startswith("run")
    images = [m for _, m in messages if m["msg_type"] == "display_data" and "image/png" in m["content"]["data"]]
    assert len(images) == 1
