"""The live dashboard in a real kernel: figures redraw while the cell runs, and a PNG stays behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
import torch.nn as nn
from PIL import Image

import nbfsdp
from nbfsdp.helpers import drawing
from nbfsdp.shared import figures
from nbfsdp.shared.config import FSDPConfig, for_device
from nbfsdp.shared.devices import Devices, on_gpus
from nbfsdp.ui import dashboard as dashboard_module
from nbfsdp.ui import renderer
from nbfsdp.ui.dashboard import DashboardCalls, LiveDashboard, RankHosts
from tests.conftest import child_with, gone, left_behind, soon
from tests.test_kernel import Kernel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: The docs' picture of a dashboard (README, docs/index.md): tests/test_browser.py takes it, and records in it
#: the controls and buttons it shows, under this PNG text key.
DOCS_IMAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "images" / "dashboard.png"
IMAGE_PARTS_KEY = "nbfsdp:parts"
#: The picture's last part: the timeline panel (issue 56), which a dashboard shows once a step was captured.
TIMELINE_PART = "timeline panel"

#: A dashboard's controls wired to nothing: these tests drive the figures, not the session.
QUIET_CALLS = DashboardCalls(on_change=lambda change: "", on_stop=lambda: None)


def image_parts(path: pathlib.Path = DOCS_IMAGE) -> list[str] | None:
    """The controls and buttons the dashboard had when its picture at ``path`` was taken; None if not recorded."""
    recorded = Image.open(path).text.get(IMAGE_PARTS_KEY) if path.exists() else None
    return json.loads(recorded) if recorded else None


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
    idle_before = psutil.cpu_times().idle
    reply, messages = kernel.execute(TEN_SECONDS)
    assert reply["content"]["status"] == "ok"
    end = messages[-1][0]
    idle_cores = (psutil.cpu_times().idle - idle_before) / end  # what the machine left idle, on average
    updates = _figure_updates(messages)
    assert end > 9
    assert updates and updates[-1] > end - 1, (updates, end)  # the final figure, however busy the machine
    # live: the drawing worker draws with the CPU time nothing else wants (SCHED_IDLE), so what it draws depends
    # on what the machine left idle (measured, not assumed: other programs, the suite's other worker). Where at
    # least half a core was idle: live from the start (the first figure in the cell's first half, under 2 s
    # of 10 when idle), at least 5, and still redrawing near the end (within two of the longest pauses between
    # drawings, the back-off while no core is idle)
    if idle_cores >= 0.5:
        assert len(updates) >= 5, (updates, idle_cores)
        assert updates[0] < end / 2, (updates[0], end)
        assert updates[-2] > end - 2 * dashboard_module.MAX_REDRAW_SECONDS, (updates, end)
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


class _Clicker:
    """Once the cell's dashboard shows the widget described ``description``, act on it as a person would."""

    def __init__(self, kernel, description: str, data: dict, after_records: int = 1) -> None:
        self.kernel, self.description, self.data = kernel, description, data
        self.after_records = after_records
        self.comm_id: str | None = None
        self.figures = 0
        self.sent_at: float | None = None

    def __call__(self, msg: dict) -> None:
        content = msg["content"]
        if msg["msg_type"] == "comm_open":
            state = content["data"].get("state", {})
            if state.get("description") == self.description:
                self.comm_id = content["comm_id"]
        if msg["msg_type"] == "comm_msg" and ["value"] in content["data"].get("buffer_paths", []):
            self.figures += 1  # a drawing: records are arriving, the cell is training (under 6 s however busy)
        if self.comm_id and self.figures >= self.after_records and self.sent_at is None:
            self.kernel.send_widget_message(self.comm_id, self.data)
            self.sent_at = time.monotonic()


@pytest.mark.floor
def test_a_toggle_clicked_while_the_cell_runs_applies_on_every_rank(kernel):
    clicker = _Clicker(kernel, "activation checkpointing", {"method": "update", "state": {"value": True}})
    reply, messages = kernel.execute(
        TEN_SECONDS.replace(
            "nbfsdp.log(step=step", "nbfsdp.log(ckpt=ckpt.state(model[0]).enable_hook, step=step"
        ).replace("import time", "import time\nfrom torch.distributed._composable import checkpoint as ckpt"),
        on_message=clicker,
    )
    assert reply["content"]["status"] == "ok" and clicker.sent_at is not None
    _, messages = kernel.execute(
        "run = nbfsdp.last_run()\nprint((run.changes, [run.metric('ckpt', r) for r in (0, 1)]))"
    )
    changes, flags = eval(kernel.stdout(messages))
    assert len(changes) == 1 and changes[0][1] == "activation_checkpointing=True"
    step = changes[0][0]
    assert 0 < step < 49
    assert flags == [[s >= step for s in range(50)]] * 2  # both ranks, from the same step on


@pytest.mark.floor
def test_the_stop_button_ends_the_cell_at_a_step_boundary(kernel):
    clicker = _Clicker(kernel, "Stop", {"method": "custom", "content": {"event": "click"}})
    started = time.monotonic()
    reply, _ = kernel.execute(TEN_SECONDS.replace("range(50)", "range(500)"), on_message=clicker)
    assert reply["content"]["status"] == "ok"
    # about 1 s after the click when idle, 20 s once beside a full suite and two busy loops: printed, not judged
    # (a hang is the suite's timeout's); `last < 499` below is what shows the early stop: 500 steps take ~100 s
    print(f"ended {time.monotonic() - clicker.sent_at:.1f} s after the click, {time.monotonic() - started:.1f} s in")
    _, messages = kernel.execute(
        "run = nbfsdp.last_run()\nprint((run.ok, run.cancelled, [run.metric('step', r)[-1] for r in (0, 1)]))"
    )
    ok, cancelled, last = eval(kernel.stdout(messages))
    assert ok and cancelled and last[0] == last[1] < 499


def _dashboard(predicted: list[dict[str, int]] | None = None) -> LiveDashboard:
    """A 2-rank CPU dashboard with default settings, fed by hand."""
    settings = {**dataclasses.asdict(for_device(FSDPConfig(), Devices("cpu", 2))), "world_size": 2}
    return LiveDashboard(Devices("cpu", 2), settings=settings, calls=QUIET_CALLS, predicted=predicted)


def test_mid_run_changes_are_marked_on_the_figures_next_to_predicted_comm_buffers(shell):
    """The figures a person sees: the step a setting changed, written on its marker; explain's buffers."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    predicted = nbfsdp.explain(model, world_size=2, wrap_cls="Linear").memory
    assert predicted[0]["comm_buffers"] > 0
    dashboard = _dashboard(predicted)
    memory = {"mem_params": 1000, "mem_grads": 1000, "mem_optim": 2000, "mem_activations": 500, "mem_peak": 4000}
    records = [
        {"rank": r, "step": s, "step_time": 0.01, "loss": 1 / (s + 1), **memory} for s in range(6) for r in (0, 1)
    ]
    for record in records[6:8]:  # step 3, both ranks
        record["changed"] = "activation_checkpointing=True"
    dashboard.add(records)
    loss_axes, memory_axes, time_axes = dashboard.figure().axes
    for axes in (loss_axes, time_axes):
        assert [text.get_text() for text in axes.texts] == ["step 3: activation_checkpointing=True"]
        assert [line.get_xdata()[0] for line in axes.lines if line.get_linestyle() == ":"] == [3]
    assert "comm buffers (explain)" in memory_axes.get_legend_handles_labels()[1]


def test_each_ranks_predicted_peak_is_drawn_beside_its_measured_peak(shell):
    """explain's traced peak (dashed) comes while the cell runs; the measured one is the highest ``mem_peak``
    so far; a live figure in the drawing worker takes the prediction with its next drawing."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    planned = nbfsdp.explain(model, world_size=2, wrap_cls="Linear", batch=torch.empty(8, 16, device="meta"))
    dashboard = _dashboard(planned.memory)
    peaks = [rank["total"] for rank in planned.peak]
    dashboard.predict_peaks(peaks, "8x16 float32 a rank")
    assert "explain predicts a peak of" in dashboard._notes[-1] and "8x16 float32 a rank" in dashboard._notes[-1]
    records = [
        {"rank": r, "step": s, "step_time": 0.01, "mem_params": 1000, "mem_peak": (s + 1) * 2**20 * (r + 1)}
        for s in range(3) for r in (0, 1)
    ]  # fmt: skip
    dashboard.add(records)
    memory_axes = dashboard.figure().axes[1]
    lines = {line.get_label(): line for line in memory_axes.lines}
    assert {"peak (explain)", "peak so far (measured)"} <= set(lines)

    def heights(style: str) -> list[float]:
        return [
            line.get_ydata()[0]
            for line in memory_axes.lines
            if line.get_color() == figures.PEAK_COLOR and line.get_linestyle() == style
        ]

    assert heights("--") == pytest.approx([peak / 2**20 for peak in peaks])
    assert heights("-") == [3.0, 6.0]  # each rank's highest mem_peak, MiB
    # the worker's live figure, made before the trace was done, draws the prediction once it comes
    key = "predicted-peak-test"
    drawing.draw(key, 2, planned.memory, records[:2], 0, final=False)
    assert drawing._figures[key].memory.predicted_peaks == []
    drawing.draw(key, 2, dashboard.predicted, records[2:], 2, final=False)
    assert drawing._figures[key].memory.predicted_peaks == peaks
    drawing._figures.pop(key)


def test_ranks_on_two_hosts_show_their_host_and_what_crosses_between_hosts(shell):
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    plan = nbfsdp.explain(model, world_size=4, hosts=["a", "a", "b", "b"], wrap_cls="Linear")
    settings = {**dataclasses.asdict(for_device(FSDPConfig(), Devices("cpu", 4))), "world_size": 4}
    dashboard = LiveDashboard(
        Devices("cpu", 4),
        settings=settings,
        calls=QUIET_CALLS,
        predicted=plan.memory,
        hosts=RankHosts(each=plan.hosts, across=plan.hosts_lines()),
    )
    table = dashboard._status.value
    assert "<th>rank</th><th>host</th>" in table
    for rank, host in enumerate(["a", "a", "b", "b"]):
        assert f"<tr><td>{rank}</td><td>{host}</td>" in table
    assert "mesh (replicate 1, shard 4): shard groups across hosts" in table and "all-gather: crosses hosts" in table
    assert "<th>host</th>" not in _dashboard()._status.value  # one host: no column


def test_an_async_cell_returns_at_once_and_its_dashboard_stays_live(kernel, tmp_path):
    """The cell trains until the test has seen its figure change three times after the cell returned (waiting
    for that, not a fixed time: a machine whose cores other programs keep busy draws less often)."""
    stop = tmp_path / "stop"
    cell = TEN_SECONDS.replace("%%fsdp --world-size 2", "%%fsdp --world-size 2 --async").replace(
        "for step in range(50):", f"import os\nstep = -1\nwhile not os.path.exists({str(stop)!r}):\n    step += 1"
    )
    started = time.monotonic()
    reply, _ = kernel.execute(cell)
    try:
        # it did not wait for the ranks: the reply comes at once (under 1 s when idle; a hang guard here)
        assert reply["content"]["status"] == "ok" and time.monotonic() - started < 30
        redraws_after_return = []
        # the kernel is idle; the figure keeps changing: a drawing each second on an idle machine, each 3 s at
        # most while the ranks keep every core busy, each 6 s drawn in the kernel while other programs do
        deadline = time.monotonic() + 120  # a hang guard
        while len(redraws_after_return) < 3 and time.monotonic() < deadline:
            try:
                msg = kernel.client.get_iopub_msg(timeout=0.2)
            except Exception:
                continue
            if msg["msg_type"] == "comm_msg" and ["value"] in msg["content"]["data"].get("buffer_paths", []):
                redraws_after_return.append(msg)
        assert len(redraws_after_return) >= 3
    finally:  # the module's next tests share the kernel: this cell must be over for them, pass or fail
        stop.touch()
        reply, messages = kernel.execute("%fsdp wait\nprint(len(nbfsdp.last_run().metrics))")
    assert reply["content"]["status"] == "ok" and int(kernel.stdout(messages).splitlines()[-1]) >= 2 * 3


def test_a_live_drawing_the_worker_gets_no_cpu_for_is_drawn_in_the_kernel(shell):
    """Other programs keep every core busy: the worker, at SCHED_IDLE, draws nothing (stopped here with SIGSTOP,
    which it cannot tell from starving). After ``STARVED_SECONDS`` the dashboard draws the figure itself, and the
    worker's drawing, when it comes, does not replace the newer one."""
    dashboard = _dashboard()
    dashboard.add(_records(range(10)))
    dashboard.refresh()
    _wait_for_drawing(dashboard, 1)
    worker = psutil.Process(renderer.worker_pid())
    worker.suspend()
    try:
        dashboard.add(_records(range(10, 20)))
        dashboard._last_draw = 0.0  # its pause is over
        dashboard.refresh()  # to the stopped worker
        pending = dashboard._drawing
        assert pending is not None and not pending.done() and dashboard.redraws == 1
        dashboard.refresh()
        assert dashboard.redraws == 1  # a drawing is under way, and not for long yet
        dashboard._last_draw = time.monotonic() - dashboard_module.STARVED_SECONDS
        dashboard.refresh()
        assert dashboard.redraws == 2 and dashboard._drawing is None and dashboard._drawn_records == 0
        drawn_here = bytes(dashboard._figure.value)
        assert drawn_here.startswith(b"\x89PNG")
    finally:
        worker.resume()
    pending.result(timeout=30)  # the worker's own drawing ends, late
    time.sleep(0.2)  # its callback runs just after its waiters wake
    assert dashboard.redraws == 2 and bytes(dashboard._figure.value) == drawn_here
    dashboard.finish(None, "done")


def _capture(rank: int) -> dict:
    """A captured step as a rank sends it (``engines/timeline.py``): one gather, its compute, one reduction."""
    settings = {"sharding_strategy": "FULL_SHARD", "reshard_after_forward": True, "mixed_precision": "FULL",
                "forward_prefetch": False, "backward_prefetch": "BACKWARD_PRE", "activation_checkpointing": False,
                "cpu_offload": False}  # fmt: skip
    events = [
        {"lane": "all_gather", "name": "all_gather", "unit": "0", "start_ms": 0.0, "ms": 2.0, "bytes": 2**20},
        {"lane": "compute", "name": "forward", "unit": "0", "start_ms": 2.0, "ms": 5.0, "bytes": 0},
        {"lane": "reduce_scatter", "name": "reduce_scatter", "unit": "0", "start_ms": 7.0, "ms": 2.0, "bytes": 2**20},
    ]
    return {"rank": rank, "step": 1, "forward": 1, "step_ms": 9.0, "comm_ms": 4.0, "exposed_comm_ms": 4.0,
            "device": "cpu", "shards": 2, "post_forward_group": None, "clock_ns": 0, "clock_offset_ms": 0.0,
            "settings": settings, "events": events, "allocated_peak": None}  # fmt: skip


def test_a_timeline_panel_the_worker_gets_no_cpu_for_is_drawn_in_the_kernel_at_the_cells_end(shell, monkeypatch):
    """Under a machine whose every core is busy the worker (SCHED_IDLE) draws nothing (stopped here with SIGSTOP):
    at the cell's end the panel draws its last step itself, as the dashboard's final figure is drawn, instead of
    ending with no picture (seen under a loaded suite run), and as soon as it sees the worker get no CPU, not
    after the most the end of a cell waits (every cell beside two busy loops ended 10 to 20 s late). What is timed
    is each wait for the worker, not the drawing here that follows it: that takes what the machine's load makes of
    a tenth of a second of CPU (2.5 s in a run beside two busy loops)."""
    import ipywidgets as widgets

    from nbfsdp.ui.timeline_panel import TimelinePanel

    waits: list[tuple[float, bool]] = []  # each wait for the worker's drawing: its seconds, whether it came
    wait_for_worker = renderer.done_unless_starved

    def timed(drawing, seconds: float) -> bool:
        started = time.monotonic()
        done = wait_for_worker(drawing, seconds)
        waits.append((time.monotonic() - started, done))
        return done

    monkeypatch.setattr(renderer, "done_unless_starved", timed)
    given_up_early = dashboard_module.FINAL_DRAWING_SECONDS / 4  # seen starved in a window of 0.25 s, not at 10 s
    panel = TimelinePanel(widgets.VBox(), world_size=2)
    dashboard = _dashboard()
    dashboard.add(_records(range(10)))
    worker = psutil.Process(renderer.worker_pid())
    worker.suspend()
    try:
        panel.add(_capture(0))
        panel.add(_capture(1))  # every rank's capture of the step: drawn, by the stopped worker
        assert panel._image is not None and not panel._image.value
        panel.wait(dashboard_module.FINAL_DRAWING_SECONDS)
        assert len(waits) == 1 and waits[0][1] is False and waits[0][0] < given_up_early, waits
        drawn_here = bytes(panel._image.value)
        assert drawn_here.startswith(b"\x89PNG")
        dashboard.finish(None, "done")  # its final figure, from every record: drawn here too
        assert len(waits) == 2 and waits[1][1] is False and waits[1][0] < given_up_early, waits
        assert bytes(dashboard._figure.value).startswith(b"\x89PNG") and dashboard.redraws == 1
    finally:
        worker.resume()
    time.sleep(1.0)  # the worker's late drawing does not replace it
    assert bytes(panel._image.value) == drawn_here


def test_a_rank_state_shows_in_its_row_at_once_with_no_drawing_due(shell):
    """A rank stopped at a breakpoint holds the kernel at its prompt, where no drawing falls due: its row says so
    at once, not at the next drawing (a loaded run's dashboard never showed it: the drawing was a pause away)."""
    dashboard = _dashboard()
    dashboard.add(_records(range(10)))
    dashboard.refresh()  # its first points, drawn: the next drawing is a pause away
    dashboard.rank_state(1, "stopped at a breakpoint (cell line 6): the prompt is below the cell")
    dashboard.refresh()  # as the breakpoint does: not due
    assert "stopped at a breakpoint (cell line 6)" in dashboard._status.value
    dashboard.rank_state(1, "running")
    assert "stopped at a breakpoint" not in dashboard._status.value


def test_figures_are_drawn_by_a_process_of_the_lowest_cpu_priority_in_a_session_of_its_own(shell):
    """Ranks share the cores with the notebook: a drawing may only take CPU time they leave idle.

    Linux shares CPU between sessions first (autogroup), so the worker has its own, lowered.
    """
    dashboard = _dashboard()
    dashboard.add([{"rank": r, "step": s, "step_time": 0.01, "loss": 1.0} for s in range(200) for r in (0, 1)])
    dashboard.refresh()
    assert dashboard.redraws == 0 and not dashboard._figure.value  # the caller went on without drawing
    idle_before, deadline = psutil.cpu_times().idle, time.monotonic() + 30
    while not dashboard.redraws and time.monotonic() < deadline:
        time.sleep(0.05)
    if dashboard.redraws or psutil.cpu_times().idle - idle_before >= 1.0:
        assert dashboard.redraws == 1 and bytes(dashboard._figure.value).startswith(b"\x89PNG")
    else:  # every core was busy for 30 s (a loaded machine): the worker rightly took none of it
        print("no idle CPU in 30 s: the worker drew nothing, as it should")
    worker = psutil.Process(renderer.worker_pid())
    assert worker.nice() == 19 and os.getpriority(os.PRIO_PROCESS, 0) == 0  # the kernel's own: untouched
    assert os.sched_getscheduler(worker.pid) == os.SCHED_IDLE != os.sched_getscheduler(0)
    assert os.getsid(worker.pid) == worker.pid != os.getsid(0)
    # "/autogroup-N nice K" where autogroup governs; empty inside a cgroup (CI containers), absent without it
    ours = _read_if_exists("/proc/self/autogroup")
    if ours:
        assert _read_if_exists(f"/proc/{worker.pid}/autogroup").split()[-1] == "19" and ours.split()[-1] == "0"


def _read_if_exists(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except FileNotFoundError:
        return ""


def test_the_drawing_process_ends_with_its_kernel():
    k = Kernel()
    try:
        _, messages = k.execute("from nbfsdp.ui import renderer\nprint(renderer.worker_pid())")
        worker = psutil.Process(int(k.stdout(messages).split()[-1]))
        assert worker.is_running() and worker.ppid() == k.manager.provisioner.pid
    finally:
        k.shutdown()  # now=True: the kernel is killed, nothing of its own runs at exit
    worker.wait(timeout=10)  # raises TimeoutExpired if the worker outlives its kernel


def test_a_drawing_process_whose_kernel_went_mid_drawing_ends_without_a_traceback():
    """Seen in the suite's output after a kernel was shut down: the worker's answer met a closed pipe. Started here
    in this test's own session, the worker leaves that session's CPU share as it was (it lowered the whole suite's
    once: its autogroup's nice is its session's)."""
    ours = _read_if_exists("/proc/self/autogroup")
    worker = subprocess.Popen(
        [sys.executable, "-m", "nbfsdp.helpers.drawing", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    worker.stdout.close()  # the kernel's end of the replies, gone before the answer
    worker.stdin.write(pickle.dumps((1, time.sleep, (0.2,))))
    worker.stdin.close()
    worker.wait(timeout=60)
    stderr = worker.stderr.read().decode()
    assert worker.returncode == 0 and "Traceback" not in stderr, stderr
    assert _read_if_exists("/proc/self/autogroup") == ours


#: A kernel's part in the next test: its drawing worker first asked for from a thread, which ends when told.
ASKED_FROM_A_THREAD = """
import sys, threading, time
from nbfsdp.ui import renderer

def ask():
    renderer.start()
    print("asked", flush=True)
    sys.stdin.readline()

asker = threading.Thread(target=ask)
asker.start()
asker.join()
print("ended", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling policy and parent-death signal")
def test_a_drawing_worker_that_gets_no_cpu_ends_with_its_killed_kernel():
    """At idle priority on a machine another program keeps busy, the worker gets no CPU to see its kernel's end
    (a suite run beside a busy program found one alive 30 s after its kernel was killed): Linux ends it. Stopped
    (no CPU at all), its kernel killed with SIGKILL, it is gone at once. First asked for from a thread that has
    since ended, it still runs: the parent-death signal follows the thread that started it, the renderer's own."""
    kernel = subprocess.Popen(
        [sys.executable, "-c", ASKED_FROM_A_THREAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    worker = None
    try:
        assert kernel.stdout.readline() == "asked\n"
        worker = soon(lambda: child_with(psutil.Process(kernel.pid), "nbfsdp.helpers.drawing"))
        soon(lambda: os.sched_getscheduler(worker.pid) == os.SCHED_IDLE)  # it has asked for the signal by then
        kernel.stdin.write("\n")
        kernel.stdin.flush()
        assert kernel.stdout.readline() == "ended\n"
        time.sleep(0.5)
        assert not gone(worker.pid)  # the asking thread's end did not end it
        worker.suspend()
        kernel.kill()
        kernel.wait()
        assert left_behind([worker.pid], 10) == []
    finally:
        kernel.kill()
        if worker is not None:
            with contextlib.suppress(psutil.Error):
                worker.kill()


def _records(steps: range, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    return [{"rank": r, "step": s, "step_time": 0.01, "loss": 1 / (s + 1)} for s in steps for r in ranks]


def _wait_for_drawing(dashboard: LiveDashboard, redraws: int) -> None:
    """Until the dashboard has ``redraws`` drawings. The worker draws with CPU time nothing else wants (the
    priority test holds that); these tests check what it draws, so on a machine with no idle CPU its current
    process is given a share like any other's while it is waited for (as root; else it waits as it is), and its
    own priority back after."""
    with contextlib.ExitStack() as shares:
        deadline = time.monotonic() + 30
        while (dashboard.redraws < redraws or not dashboard._drawing.done()) and time.monotonic() < deadline:
            worker = renderer._worker  # a worker that died is replaced by a new process as the drawing is sent
            pid = worker.process.pid if worker is not None and worker.alive else None
            with contextlib.suppress(OSError):  # a new worker puts itself at idle priority as it starts: again
                if pid and os.sched_getscheduler(pid) != os.SCHED_OTHER:
                    shares.enter_context(_normal_share(pid))
            time.sleep(0.02)


@contextlib.contextmanager
def _normal_share(pid: int | None) -> Iterator[None]:
    autogroup = pathlib.Path(f"/proc/{pid}/autogroup")
    policy = nice = 0
    try:
        if pid:
            policy, nice = os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:  # the worker just ended
        pid = None
    if pid:
        with contextlib.suppress(OSError):  # not root, or the worker ended meanwhile
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, pid, 0)
            autogroup.write_text("0")  # its session's share, where autogroup governs
    try:
        yield
    finally:
        if pid:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(pid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, pid, nice)
                autogroup.write_text(str(nice))


def test_live_drawings_add_new_records_to_the_workers_figure_and_start_afresh_when_it_was_lost(shell):
    """Only the records since the last drawing travel; a worker that died (and its figure with it) is
    replaced, the drawing that found no figure fails, and the next sends every record again."""
    dashboard = _dashboard()
    dashboard.add(_records(range(10)))
    dashboard.refresh()
    _wait_for_drawing(dashboard, 1)
    dashboard.add(_records(range(10, 15)))
    dashboard._last_draw = 0.0  # its pause is over
    dashboard.refresh()
    _wait_for_drawing(dashboard, 2)
    assert dashboard._drawn_records == 30  # 20 records, then 10 more: the worker's figure had the 20
    psutil.Process(renderer.worker_pid()).kill()
    dashboard.add(_records(range(15, 16)))
    dashboard._last_draw = 0.0
    dashboard.refresh()  # to the dead worker, or to its replacement, which has no figure to add to
    assert dashboard._drawing.exception(timeout=30) is not None and dashboard.redraws == 2
    deadline = time.monotonic() + 5  # the future's callbacks run just after its waiters wake
    while dashboard._drawn_records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dashboard._drawn_records == 0
    dashboard._last_draw = 0.0
    dashboard.refresh()
    _wait_for_drawing(dashboard, 3)
    assert dashboard.redraws == 3 and dashboard._drawn_records == 32
    assert _worker_keeps_figure(dashboard._key)
    dashboard.finish(None, "done")  # the final drawing, from every record; then the worker drops the figure
    assert dashboard.redraws == 4 and not _worker_keeps_figure(dashboard._key)


def _worker_keeps_figure(key: str) -> bool:
    # evaluated in the worker (a function of this module would make it import the test suite)
    return renderer._submit(
        eval, f"{key!r} in __import__('nbfsdp.helpers.drawing', fromlist=['_figures'])._figures"
    ).result()


def test_drawings_keep_to_a_hundredth_of_a_core_while_every_core_is_busy(shell):
    """Even a SCHED_IDLE drawing slows ranks that keep every core busy (12% of a core cost two ranks on two
    cores 6% of each step): the pause after a drawing stretches to 100 times its CPU time."""
    dashboard = _dashboard()
    dashboard.add(_records(range(50)))
    dashboard.refresh()
    _wait_for_drawing(dashboard, 1)
    assert 0 < dashboard._drawing_cpu < 1
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        for _ in range(2):  # the idle share is measured over about a second
            dashboard._watch_idle_cores(time.monotonic())
            time.sleep(1.1)
        dashboard._watch_idle_cores(time.monotonic())
        assert dashboard._idle_cores < 0.5
        busy_pause = dashboard._pause()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    expected = max(1.0, dashboard._drawing_cpu / dashboard_module.BUSY_DRAWING_CPU_SHARE)
    assert busy_pause == pytest.approx(min(dashboard_module.MAX_REDRAW_SECONDS, expected))
    # a core idle again: set, not measured, as whether one is idle now depends on what else the machine runs;
    # the pause follows the idle share (a slow machine's drawing may cost enough CPU that both are capped)
    dashboard._idle_cores = 1.0
    idle_pause = min(
        dashboard_module.MAX_REDRAW_SECONDS, max(1.0, dashboard._drawing_cpu / dashboard_module.DRAWING_CPU_SHARE)
    )
    assert dashboard._pause() == pytest.approx(idle_pause) and idle_pause <= busy_pause
    dashboard._drawing_cpu = 0.02  # a drawing of 20 ms of CPU: 1 s apart while a core is idle, 2 s while none is
    assert dashboard._pause() == pytest.approx(1.0)
    dashboard._idle_cores = 0.0
    assert dashboard._pause() == pytest.approx(2.0)


def test_ranks_that_share_a_gpu_are_said_to_share_it_above_their_rows(shell):
    settings = {**dataclasses.asdict(for_device(FSDPConfig(), on_gpus(4, 1))), "world_size": 4}
    dashboard = LiveDashboard(on_gpus(4, 1), settings=settings, calls=QUIET_CALLS)
    table = dashboard._status.value
    assert "<div>4 ranks on 1 GPU (shared)</div>" in table
    assert all(f"<tr><td>{rank}</td><td></td><td></td><td>cuda:0</td>" in table for rank in range(4)), table
    assert dashboard.controls.values()["device"] == "cuda"
    assert "<div>2 ranks on the CPU (gloo)</div>" in _dashboard()._status.value


def test_the_dashboard_says_which_models_live_on_the_ranks(kernel):
    """Issue 43 (point 3): a model that lives on the ranks (here by --keep-on-ranks) is named on its cell's
    dashboard, as its repr and %fsdp status name it."""
    kernel.execute("kept = nn.Linear(4, 4)")
    reply, messages = kernel.execute("%%fsdp --world-size 2 --keep-on-ranks\nkept")
    assert reply["content"]["status"] == "ok"
    said = [str(m["content"]) for _, m in messages if m["msg_type"] in ("comm_open", "comm_msg")]
    assert any("kept: weights live on the ranks only" in text for text in said)
    reply, messages = kernel.execute("print(repr(kept).splitlines()[1])")
    assert "on the 2 ranks only" in kernel.stdout(messages)
    kernel.execute("del kept")  # the next cells may start another world (another --timeout) without it


def test_the_dashboard_says_what_trains_of_a_model_with_frozen_parameters(kernel):
    """Issue 44 (point 1): frozen parameters have no gradient or optimizer state, and the dashboard says so."""
    kernel.execute("half = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\nhalf[0].requires_grad_(False)")
    reply, messages = kernel.execute("%%fsdp --world-size 2\nhalf")
    assert reply["content"]["status"] == "ok"
    said = [str(m["content"]) for _, m in messages if m["msg_type"] in ("comm_open", "comm_msg")]
    assert any("half: 10 parameters train; 20 frozen have no gradient or optimizer state" in text for text in said)


def test_a_hang_report_marks_the_stuck_rank_and_the_rank_it_waits_for_in_their_rows(kernel):
    """Issue 45 (point 3): when the cell reports a hang by itself, its dashboard's rows say which rank is stuck,
    in which collective, since when and at which cell line, and which rank has not issued it; the marks stay on
    the failed cell's dashboard after --timeout ends it."""
    reply, messages = kernel.execute(
        "%%fsdp --world-size 2 --hang-report 2 --timeout 8\nimport torch.distributed as dist\nt = torch.ones(3)\n"
        "if rank == 0:\n    dist.all_reduce(t)  # rank 1 never joins\n"
    )  # fmt: skip
    assert reply["content"]["status"] == "error"  # --timeout ended it
    values = [
        m["content"]["data"].get("state", {}).get("value")
        for _, m in messages
        if m["msg_type"] in ("comm_open", "comm_msg")
    ]
    tables = [value for value in values if isinstance(value, str) and "<th>state</th>" in value]
    marked = [table for table in tables if "stuck in" in table]
    assert marked, tables[-1]
    # the numbers: collectives of the world so far (earlier cells' may count), seconds waited (at least 2)
    stuck = re.search(r"<tr><td>0</td>.*?<td><b>stuck in all_reduce #(\d+) for (\d+) s at cell line 4</b>", marked[-1])
    assert stuck and int(stuck[2]) >= 2, marked[-1]
    rank_1 = re.search(r"<tr><td>1</td>.*?<td><b>has not issued all_reduce #(\d+) \(rank 0 waits in it\)", marked[-1])
    assert rank_1 and rank_1[1] == stuck[1], marked[-1]
    said = [str(m["content"]) for _, m in messages if m["msg_type"] in ("comm_open", "comm_msg")]
    assert any("hang report: rank 0 issued all_reduce" in text for text in said)


def test_the_docs_picture_of_the_dashboard_shows_its_controls_and_buttons_as_they_are(shell):
    """docs/images/dashboard.png cannot go stale: a control or button added, renamed or removed fails here until
    tests/test_browser.py, which takes the picture again whenever what it shows differs, has run."""
    dashboard = _dashboard()
    parts = [control.description for control in dashboard.controls.widgets.values()]
    parts += [dashboard._stop.description, dashboard._where.description, TIMELINE_PART]
    assert image_parts() == parts, "run tests/test_browser.py: it takes docs/images/dashboard.png again"


def test_every_choice_of_a_dropdown_has_room_in_it(shell):
    """Left to JupyterLab's own width, the backward-prefetch dropdown cut its value to "BACKWARD_PRE": each
    dropdown is as wide as its description and its longest choice, at a generous width per letter (capitals,
    the widest, 0.72 em in DejaVu Sans). The browser test measures them as drawn."""
    for control in _dashboard().controls.widgets.values():
        if hasattr(control, "options"):
            width = control.layout.width
            assert width.endswith("em"), (control.description, width)
            needed = 0.55 * len(control.description) + 0.72 * max(map(len, control.options)) + 2
            assert float(width.removesuffix("em")) >= needed, (control.description, width)


def test_the_timeline_panel_shows_the_captured_step_and_after_a_change_the_step_before_beside_it(kernel):
    """Issue 56 (point 3): once every rank's second step is captured, the dashboard shows it lane by lane (an image
    made only then: a shorter cell costs no widget) with a table of rank 0's collectives; a toggle clicked while the
    cell runs is captured at the step it applies from, and that step stands beside the one before."""
    clicker = _Clicker(kernel, "forward prefetch", {"method": "update", "state": {"value": True}})
    cell = TEN_SECONDS.replace(
        "%%fsdp --world-size 2 --wrap-cls Linear", "%%fsdp --world-size 2 --wrap-cls Linear --timeline 1000"
    )
    reply, messages = kernel.execute(cell, on_message=clicker)
    assert reply["content"]["status"] == "ok" and clicker.sent_at is not None
    opened = [m for _, m in messages if m["msg_type"] == "comm_open"]
    images = [m for m in opened if m["content"]["data"]["state"].get("_model_name") == "ImageModel"]
    assert len(images) == 2, len(images)  # the figures', then the timeline's
    timeline_image = images[-1]["content"]["comm_id"]
    # the drawings come from the worker's thread, after the click: answering it, as ipykernel sees it
    drawn = [
        m for m in kernel.comm_messages
        if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == timeline_image
        and ["value"] in m["content"]["data"].get("buffer_paths", [])
    ]  # fmt: skip
    assert drawn, "the timeline panel was never drawn"
    tables = [
        m["content"]["data"]["state"]["value"] for m in kernel.comm_messages
        if m["msg_type"] == "comm_msg" and "bus GB/s" in str(m["content"]["data"].get("state", {}).get("value", ""))
    ]  # fmt: skip
    assert tables, "no collectives table"
    assert (
        "<b>before</b>: step" in tables[-1]
        and "<b>now</b>: step" in tables[-1]
        and "forward_prefetch=True" in tables[-1]
    )
    assert "all_gather" in tables[-1] and "reduce_scatter" in tables[-1]
    _, messages = kernel.execute(
        "print(sorted({(c['step'], c['settings']['forward_prefetch']) for c in nbfsdp.last_run().timeline}))"
    )
    captured = eval(kernel.stdout(messages))
    assert captured[0] == (1, False) and captured[-1][1] is True and len(captured) == 2, captured
