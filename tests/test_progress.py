"""Progress bars in a ``%%fsdp`` cell: rank 0's shows once, live, updated in place; the other ranks' nowhere.

Driven through a real Jupyter kernel (jupyter_client, and nbclient for a saved notebook) on a real
cluster; a terminal IPython (the ``shell`` fixture) prints a bar once, when it ends.
"""

from __future__ import annotations

import json
import re

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import run_ok
from tests.test_kernel import warm_kernel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 20

BAR = """%%fsdp --world-size 2 {flags}
import time
from {module} import tqdm
for step in tqdm(range({steps}), desc="train"):
    time.sleep(0.1)
"""

# The same lines in the notebook and on every rank: how often the bars call iter(), what they count, their class.
PATTERN = """from tqdm.auto import tqdm
class Counted:
    calls = 0
    def __iter__(self):
        Counted.calls += 1
        return iter(range(4))
    def __len__(self):
        return 4
counted = Counted()
bar = tqdm(counted, desc="count")
for _ in bar:
    pass
for _ in tqdm(counted, disable=True):
    pass
print("pattern", Counted.calls, bar.n, bar.total, [cls.__name__ for cls in type(bar).__mro__])
del bar  # a bar holds its stream: it does not pickle
"""


@pytest.fixture(scope="module")
def kernel():
    k = warm_kernel("%load_ext nbfsdp\nimport nbfsdp")
    yield k
    k.shutdown()


def _bars(messages: list, desc: str) -> dict[str, list[tuple[float, str, str]]]:
    """Each display id whose displays show a bar named ``desc``: its messages as (arrival, type, text)."""
    shown: dict[str, list[tuple[float, str, str]]] = {}
    for at, msg in messages:
        if msg["msg_type"] in ("display_data", "update_display_data"):
            text = msg["content"]["data"].get("text/plain", "")
            display_id = msg["content"].get("transient", {}).get("display_id")
            if display_id in shown or text.startswith(f"{desc}:"):
                shown.setdefault(display_id, []).append((at, msg["msg_type"], text))
    return shown


def _finished(text: str, steps: int) -> bool:
    """``text`` is the "train" bar as tqdm draws it at its end."""
    return re.fullmatch(rf"train: 100%\|\S+\| {steps}/{steps} \[.*it/s\]", text) is not None


@pytest.mark.parametrize("module", ["tqdm", "tqdm.auto", "tqdm.notebook"])
def test_rank_0s_bar_shows_once_and_updates_in_place_while_the_cell_runs(kernel, module):
    reply, messages = kernel.execute(BAR.format(flags="", module=module, steps=STEPS))
    assert reply["content"]["status"] == "ok", reply["content"]
    end = messages[-1][0]
    bars = _bars(messages, "train")
    assert len(bars) == 1  # one display: rank 0's bar, no other rank's
    (shown,) = bars.values()
    assert [kind for _, kind, _ in shown] == ["display_data"] + ["update_display_data"] * (len(shown) - 1)
    # several states arrived while the loop (2 s) still ran, not all at its end
    live = [at for at, _, text in shown if f"{STEPS}/{STEPS}" not in text]
    assert len(live) >= 4 and live[1] < end - 1.0
    # the last one, what a saved notebook keeps, is the finished bar
    assert _finished(shown[-1][2], STEPS)
    streams = kernel.stdout(messages)
    assert "[rank" not in streams and "train" not in streams and "it/s" not in streams


def test_the_saved_notebook_keeps_the_bars_last_state():
    cells = ["%load_ext nbfsdp", BAR.format(flags="", module="tqdm.auto", steps=5)]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    NotebookClient(notebook, timeout=240, kernel_name="python3").execute()
    outputs = notebook.cells[1].outputs
    bars = [o["data"]["text/plain"] for o in outputs if o.get("data", {}).get("text/plain", "").startswith("train:")]
    assert len(bars) == 1 and _finished(bars[0], 5)
    assert not any("train" in o["text"] for o in outputs if o["output_type"] == "stream")


def test_bars_keep_the_users_class_and_iter_calls_on_every_rank_and_rank_1s_draws_nothing(kernel):
    reply, messages = kernel.execute(PATTERN)
    assert reply["content"]["status"] == "ok", reply["content"]
    plain = next(line for line in kernel.stdout(messages).splitlines() if line.startswith("pattern "))
    reply, messages = kernel.execute(f"%%fsdp --world-size 2\n{PATTERN}")
    assert reply["content"]["status"] == "ok", reply["content"]
    lines = kernel.stdout(messages).splitlines()
    # tqdm.auto calls iter() in __init__ and again to walk: a DataLoader draws a seed each time
    assert [line for line in lines if line.startswith("[rank 1]")] == [f"[rank 1] {plain}"]
    assert f"[rank 0] {plain}" in lines
    assert len(_bars(messages, "count")) == 1


def test_a_background_run_shows_the_bar_in_its_dashboard(kernel):
    reply, _ = kernel.execute(BAR.format(flags="--async", module="tqdm.auto", steps=5))
    assert reply["content"]["status"] == "ok", reply["content"]
    reply, messages = kernel.execute(
        "run = nbfsdp._magics.session.active\n%fsdp wait\nimport json\nprint(json.dumps(run.dashboard.output.outputs))"
    )
    assert reply["content"]["status"] == "ok", reply["content"]
    outputs = json.loads(kernel.stdout(messages).splitlines()[-1])
    (bar,) = [o["data"]["text/plain"] for o in outputs if o["output_type"] == "display_data"]
    assert _finished(bar, 5)
    assert not any("train" in o["text"] for o in outputs if o["output_type"] == "stream")


def test_a_terminal_ipython_prints_each_bar_once_when_it_ends(shell, capsys):
    capsys.readouterr()
    run_ok(shell, BAR.format(flags="", module="tqdm", steps=5))
    err = capsys.readouterr().err
    assert "[rank" not in err
    (bar,) = [line for line in err.splitlines() if "train" in line]
    assert _finished(bar, 5)
