"""The quick start as a user sees it: JupyterLab in headless Chromium, run cell by cell by the page.

The other tests check what the kernel sends; only a browser shows that the dashboard's widgets
render, that its figure redraws while the cell runs, that a click on a toggle reaches the
ranks, and that its parts, as laid out, keep clear of each other at JupyterLab's usual width and a
narrower one. Chromium is Debian's package (``make test`` installs it when run as root); Playwright only
drives it and downloads no browser. Screenshots, JupyterLab's log and the notebook as saved go to
``test-artifacts/browser/``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import nbformat
import psutil
import pytest
from PIL import Image, PngImagePlugin
from playwright.sync_api import Locator, Page, expect, sync_playwright

from nbfsdp.ui.timeline_panel import PANEL_CLASS
from tests.test_dashboard import DOCS_IMAGE, IMAGE_PARTS_KEY, TIMELINE_PART, image_parts

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "00-quickstart.ipynb"
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# Fresh per run: the user's own settings and remembered workspace (open tabs) must not leak in.
LAB_SETTINGS = {
    # 'none' keeps every cell laid out: off-screen cells are otherwise skipped and read as invisible. The
    # preferred kernel starts without asking: under load JupyterLab's "Select Kernel" dialog came up again
    # after run_all accepted it (a fresh-clone run with both cores busy), holding every cell unrun.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,
    },
    # No "get Jupyter news?" toast over the screenshots (and no request to a news site).
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}
TOGGLE = "activation checkpointing"
# the dashboard's note once every rank switched (right after the click it only says "requested ...")
TOGGLE_APPLIED = re.compile(r"step \d+: activation_checkpointing=True on every rank")
#: The dashboard's parts as boxes: the controls, Stop, the notes and status table (HTML), the figure.
DASHBOARD_PARTS = ".widget-dropdown, .widget-checkbox, .widget-text, .widget-button, .widget-html, .widget-image"
#: Its controls and buttons, by their labels: what docs/images/dashboard.png records it shows.
CONTROLS = ".widget-dropdown, .widget-checkbox, .widget-text, .widget-button"
#: Side by side, two parts keep at least this many pixels apart: closer, "CPU offload" read "CPU offload world size".
SIDE_GAP = 8
#: The quick start's viewport (JupyterLab's usual notebook width), then a narrower one where the controls wrap.
WIDTHS = (1400, 1024)

# Outside CI a machine without them skips (installing chromium needs root); in CI, which runs
# `make test` as root, a missing browser or JupyterLab is a failure, never a silent skip.
MAY_SKIP = not os.environ.get("CI")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        MAY_SKIP and CHROMIUM is None, reason="Debian's chromium is not installed (`make test` installs it as root)"
    ),
    pytest.mark.skipif(
        MAY_SKIP and importlib.util.find_spec("jupyterlab") is None, reason="JupyterLab (the lab extra) is missing"
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def end_tree(server: subprocess.Popen) -> None:
    """Stop JupyterLab, which shuts its kernels down; then kill whatever of its tree is left.

    Kernels, the cluster's engines and its reaper run in sessions of their own, so they are
    listed before the server goes (they are reparented after) and waited for by pid.
    """
    tree = psutil.Process(server.pid).children(recursive=True) if server.poll() is None else []
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    _, alive = psutil.wait_procs(tree, timeout=15)
    for process in alive:
        process.kill()
    psutil.wait_procs(alive, timeout=10)


class Lab(NamedTuple):
    url: str  # the notebook's page, token included
    notebook: Path  # the copy JupyterLab serves and saves


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1 serving a copy of the quick start (the repository's stays untouched)."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / NOTEBOOK, root)
    settings = tmp_path / "settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    env = dict(
        os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces")
    )
    port, token = free_port(), secrets.token_hex(16)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with open(ARTIFACTS / "jupyterlab.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1"]
            + [f"--ServerApp.port={port}", f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_server(server, f"{base}/api/status?token={token}")
        yield Lab(f"{base}/lab/tree/{NOTEBOOK}?token={token}", root / NOTEBOOK)
    finally:
        end_tree(server)
        shutil.copy(root / NOTEBOOK, ARTIFACTS / f"saved-{NOTEBOOK}")


def wait_for_server(server: subprocess.Popen, status_url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"JupyterLab exited with {server.returncode}; see {ARTIFACTS / 'jupyterlab.log'}"
        try:
            with urllib.request.urlopen(status_url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {timeout:.0f} s; see {ARTIFACTS / 'jupyterlab.log'}")


def running(cell: Locator) -> bool:
    """JupyterLab's ``[*]`` prompt; queued cells show it too, so ask only once the cell has output."""
    return "*" in cell.locator(".jp-InputPrompt").inner_text()


def shot(target: Page | Locator, name: str) -> None:
    target.screenshot(path=ARTIFACTS / f"{name}.png")


#: The dashboard's figure: the first picture of the cell's output that is not the timeline panel's (whose pictures
#: change only with a captured step).
FIGURE = f".jp-OutputArea-output img:not(.{PANEL_CLASS})"


def watch_redraws(cell: Locator, wanted: int = 3) -> list[str]:
    """The distinct drawings the figure showed while the cell ran (each redraw is a new blob URL).

    Only loaded images count (the widget can start empty). Three, not two: the cell's very last
    update, as it ends, also replaces the image.
    """
    figure = cell.locator(FIGURE).first
    sources: list[str] = []
    while running(cell) and len(sources) < wanted:
        src = figure.evaluate("img => img.complete && img.naturalWidth > 0 ? img.src : null")
        if src and src not in sources:
            sources.append(src)
            shot(cell, f"running-{len(sources)}")
        time.sleep(0.2)
    return sources


def click_toggle(cell: Locator) -> str | None:
    """Tick the running cell's activation-checkpointing box; why it could not be, or None. Clicked as soon as
    the timeline panel's table shows the cell's first captured step (its second), the "before" of the toggle:
    clicked earlier, as on a loaded machine whose first step outlasted the first drawing, the change takes effect
    from that second step and no step is captured before it. Not after a redraw: on a machine with no idle CPU
    the figure is not redrawn (its worker takes idle CPU only), and watching for redraws would use up the run."""
    checkbox = cell.locator(".widget-checkbox", has_text=TOGGLE).locator("input[type=checkbox]")
    captured = cell.locator(f".widget-html.{PANEL_CLASS}", has_text=re.compile(r"now: step \d+"))
    while not (checkbox.count() and captured.count()):
        if not running(cell):
            return f"the running cell's dashboard had no {TOGGLE!r} checkbox or no captured step"
        time.sleep(0.2)
    if not running(cell):
        return f"the training cell ended before its {TOGGLE!r} checkbox could be clicked"
    checkbox.click()
    return None


def toggle_applied(cell: Locator) -> str | None:
    """Why the clicked toggle could not be seen applied, or None."""
    try:
        expect(cell.get_by_text(TOGGLE_APPLIED)).to_be_attached(timeout=60_000)
    except AssertionError:
        return f"{TOGGLE_APPLIED.pattern!r} did not appear within 60 s of clicking {TOGGLE!r}"
    finally:
        shot(cell, "toggled")
    return None


def failures(notebook: Path) -> list[str]:
    """Error outputs of the saved notebook, and code cells Run All never reached (it stops at an error).

    Read from the file, not the page: JupyterLab renders errors and the extension's legitimate
    warnings alike, as stderr.
    """
    problems = []
    for index, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if cell.execution_count is None:
            problems.append(f"cell {index} did not run")
        problems += [f"cell {index}: {out.ename}: {out.evalue}" for out in cell.outputs if out.output_type == "error"]
    return problems


def test_quickstart_in_chromium(lab: Lab) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTHS[0], "height": 1000})
        try:
            run_quickstart(page, lab)
        except BaseException:  # pytest's timeout too: the page as it was is the first thing to look at
            shot(page, "failure")
            raise
        finally:
            browser.close()


def run_all(page: Page, attempts: int = 3) -> None:
    """Run > Run All Cells, until a prompt shows the notebook started. A click while the page still
    wires up its kernel can be lost (seen once in ten runs), or answered with JupyterLab's "Select
    Kernel" dialog for the kernel it has just started (seen once): that dialog is accepted as it stands."""
    started = page.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]")).first
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    select_kernel = dialog.locator("button.jp-mod-accept")  # "Select", with the kernel already chosen
    for _ in range(attempts):
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator("li[data-command='runmenu:run-all']").click()
        if has_started(started):
            accept_late_kernel_dialog(select_kernel)
            return
        shot(page, "run-all-not-started")
        if select_kernel.count():
            select_kernel.click()
            if has_started(started):
                return
    pytest.fail(f"Run All Cells did not start the notebook in {attempts} tries")


def accept_late_kernel_dialog(select_kernel: Locator, seconds: float = 10.0) -> None:
    """The "Select Kernel" dialog can come up after the first cell ran, holding the others (seen once in a
    fresh-clone run): accepted as it stands whenever it shows in the first seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select_kernel.count():
            select_kernel.click()
        time.sleep(0.5)


def has_started(prompt: Locator) -> bool:
    try:
        expect(prompt).to_be_attached(timeout=20_000)
    except AssertionError:
        return False
    return True


def run_quickstart(page: Page, lab: Lab) -> None:
    """Run All, click the training cell's toggle and look at the cell while it runs; the toggle is checked last."""
    page.goto(lab.url)
    cell = page.locator(".jp-CodeCell").filter(has=page.locator(".jp-InputArea-editor", has_text="%%fsdp")).first
    # ready: the notebook's own cells drawn and its kernel idle in the status bar. The toolbar's execution
    # indicator alone said idle while the page still showed "No Kernel | Initializing" over a one-cell placeholder
    # (seen in a fresh-clone run): Run All then ran the placeholder, and the notebook's cells never ran
    expect(cell).to_be_attached(timeout=90_000)
    expect(page.get_by_text(re.compile(r"\(ipykernel\) \| Idle"))).to_be_visible(timeout=90_000)
    expect(page.locator(".jp-Notebook-ExecutionIndicator")).to_have_attribute("data-status", "idle", timeout=90_000)
    shot(page, "opened")
    run_all(page)

    figure = cell.locator(FIGURE).first
    expect(figure).to_be_attached(timeout=180_000)
    cell.scroll_into_view_if_needed()
    assert running(cell), "the training cell ended before its dashboard could be looked at"
    expect(cell.locator(".jp-OutputArea-output .jupyter-widgets").first).to_be_visible()
    expect(figure).to_be_visible()
    toggle_problem = click_toggle(cell)
    idle_before = psutil.cpu_times().idle
    drawings = watch_redraws(cell)
    assert drawings, "the dashboard's figure showed no drawing while the cell ran"
    idle = psutil.cpu_times().idle - idle_before
    # live drawings take only CPU time the ranks and the notebook leave idle: on a machine with none (every core
    # kept busy by other programs), a figure that stays as it was is what is wanted
    if idle >= 1.0:
        assert len(drawings) >= 3, f"{len(drawings)} drawing(s) while the cell ran, {idle:.1f} s of idle CPU"
    else:
        print(f"{len(drawings)} drawing(s) while the cell ran, with {idle:.1f} s of idle CPU: no more were due")

    toggle_problem = toggle_problem or toggle_applied(cell)

    expect(page.locator(".jp-InputPrompt", has_text="[*]")).to_have_count(0, timeout=180_000)
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.locator("li[data-command='docmanager:save']").click()
    expect(page.locator(".jp-mod-dirty")).to_have_count(0, timeout=30_000)
    shot(page, "finished")
    shot(cell, "finished-training-cell")
    problems = failures(lab.notebook)
    assert not problems, problems
    assert toggle_problem is None, toggle_problem
    check_timeline(cell)
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 1000})
        dashboard = cell.locator(".jp-OutputArea-output .widget-vbox").first
        dashboard.scroll_into_view_if_needed()
        shot(dashboard, f"dashboard-{width}")
        if width == WIDTHS[0]:
            publish(dashboard)
        clashes = overlaps(dashboard)
        assert not clashes, f"at {width} px wide (see test-artifacts/browser/dashboard-{width}.png): {clashes}"


def check_timeline(cell: Locator) -> None:
    """The dashboard's timeline panel, as the finished cell left it: its picture drawn, and its table with the
    captured step before the toggle beside the one after, each collective's size and bus bandwidth."""
    picture = cell.locator(f"img.{PANEL_CLASS}")
    expect(picture).to_be_visible()
    assert picture.evaluate("img => img.complete && img.naturalWidth > 0"), "the timeline panel drew nothing"
    table = cell.locator(f".widget-html.{PANEL_CLASS}").inner_text()
    assert re.search(r"before: step \d+, .* exposed [\d.]+ ms \(.*activation_checkpointing=False", table), table
    assert re.search(r"now: step \d+, .* exposed [\d.]+ ms \(.*activation_checkpointing=True", table), table
    assert "bus GB/s" in table and table.count("all_gather") >= 2 and "reduce_scatter" in table, table


def publish(dashboard: Locator) -> None:
    """Take the docs' picture of the dashboard (docs/images/dashboard.png) again when the controls and buttons it
    records are no longer the page's (test_dashboard fails until then); else leave it, so that a run of the
    suite changes no tracked file."""
    parts = dashboard.locator(CONTROLS).evaluate_all("parts => parts.map(p => p.innerText.trim().split('\\n')[0])")
    if dashboard.locator(f"img.{PANEL_CLASS}").count():
        parts.append(TIMELINE_PART)
    if image_parts() == parts:
        return
    taken = ARTIFACTS / "docs-dashboard.png"
    dashboard.screenshot(path=taken)
    recorded = PngImagePlugin.PngInfo()
    recorded.add_text(IMAGE_PARTS_KEY, json.dumps(parts))
    Image.open(taken).save(DOCS_IMAGE, pnginfo=recorded, optimize=True)


class Part(NamedTuple):
    name: str
    x0: float
    y0: float
    x1: float
    y1: float


def overlaps(dashboard: Locator) -> list[str]:
    """Where the dashboard's parts, as laid out, overlap or stand closer than ``SIDE_GAP`` side by side, and
    which part's own content (a label, a value) spills out of its box into a neighbour's.

    What is drawn inside the figure (legends, change labels) is one image here: test_figures checks it.
    """
    parts = []
    for index in range(dashboard.locator(DASHBOARD_PARTS).count()):
        part = dashboard.locator(DASHBOARD_PARTS).nth(index)
        box = part.bounding_box()
        if box and box["width"] and box["height"]:  # the notes stay empty until a setting changes
            name = repr(part.inner_text().strip().split("\n")[0][:40] or "figure")  # a dropdown lists its options next
            parts.append(Part(name, box["x"], box["y"], box["x"] + box["width"], box["y"] + box["height"]))
    assert len(parts) >= 11, parts  # 7 settings, Stop, notes, status, figure
    problems = []
    for index, a in enumerate(parts):
        for b in parts[index + 1 :]:
            if a.y0 < b.y1 and b.y0 < a.y1 and a.x0 < b.x1 + SIDE_GAP and b.x0 < a.x1 + SIDE_GAP:
                problems.append(f"{a.name} and {b.name} overlap or stand closer than {SIDE_GAP} px")
    spills = dashboard.locator(DASHBOARD_PARTS).evaluate_all(SPILLS)
    return problems + [f"{name} spills out of its box" for name in spills]


#: Parts whose descendants reach outside the part's box, whose text field hides part of its value, or whose
#: dropdown is too narrow for one of its choices (a browser cuts a select's shown value with no overflow to see).
SPILLS = """parts => {
    const text = document.createElement("canvas").getContext("2d");
    const cutsAChoice = select => {
        const style = getComputedStyle(select);
        text.font = `${style.fontStyle} ${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
        const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        return Array.from(select.options).some(option => text.measureText(option.text).width > room);
    };
    return parts.filter(part => {
        const box = part.getBoundingClientRect();
        const outside = Array.from(part.querySelectorAll("*")).some(child => {
            const inner = child.getBoundingClientRect();
            return inner.width && (inner.left < box.left - 1 || inner.right > box.right + 1);
        });
        const clipped = Array.from(part.querySelectorAll("input[type=number], input[type=text]"))
            .some(input => input.scrollWidth > input.clientWidth);
        return outside || clipped || Array.from(part.querySelectorAll("select")).some(cutsAChoice);
    }).map(part => JSON.stringify(part.innerText.trim().split("\\n")[0].slice(0, 40)));
}"""
