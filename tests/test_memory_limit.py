"""Out of memory on purpose (issue 45, points 1 and 2): ``--memory-limit`` gives CPU ranks the error a GPU gives,
and the cell's report sets each rank's bytes by category beside the planner's, names what ran out, and offers
the settings the planner traced to fit, every one of which then runs. Real ranks, real FSDP2, real gloo;
PyTorch's FSDPMemTracker is the accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.cluster.rank_calls import RankOutOfMemory
from nbfsdp.kernel.planning.peak import CATEGORIES
from nbfsdp.shared.config import resolve
from nbfsdp.ui.controls import SettingsControls, size_words
from tests.conftest import forget_after_each_test, gpu, run_failing, run_ok

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MODEL = """
import torch, torch.nn as nn
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
class Net(nn.Module):
    def __init__(self, width=256, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
torch.manual_seed(0)
net = Net()
"""
#: Three AdamW steps on 512 rows a rank; the loss a sum, as the planner's own (a mean's backward makes one
#: more activation-sized temporary, which the planner, not knowing the cell's loss, would not count).
CELL = """%%fsdp --world-size 2 --wrap-cls Block {flags}
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(512, 256, device=device)
{backward}
    opt.step(); opt.zero_grad()
    nbfsdp.log(loss=loss)
"""
ONE_BATCH = "    loss = net(x).sum()\n    loss.backward()"
#: The planner's fix for gradient accumulation: each rank's batch in ``micro`` parts, a backward each.
MICRO_BATCHES = """    for part in x.chunk({micro}):
        loss = net(part).sum() / {micro}
        loss.backward()"""
LIMIT = "30MB"  # the step peaks at 32 MiB a rank (traced and measured): it runs out in the first backward

forget = forget_after_each_test(
    "net",
    "Net",
    "Block",
    "opt",
    "x",
    "part",
    "loss",
    "step",
    "limits",
    "fraction",
    "fractions",
    "huge",
    "reserved",
    "after",
)


def cell(flags: str = "", micro: int = 1) -> str:
    return CELL.format(flags=flags, backward=MICRO_BATCHES.format(micro=micro) if micro > 1 else ONE_BATCH)


@pytest.fixture
def net(shell):
    """The model in the notebook, not yet on the ranks: what the planner needs."""
    run_ok(shell, MODEL)


@pytest.fixture
def model(shell, net):
    run_ok(shell, cell())  # the world up, its engines warm


#: The fixes the report past ``LIMIT`` offers, kept from the first cell here that ran past it: the same model, cell
#: and limit give the same report (the planner's search has a budget of recordings, not of time), so the test that
#: runs every fix need not make it again (a failed cell, a world set up again and the search: seconds of CPU).
_fixes_past_the_limit: dict[str, list[dict]] = {}


def _run_past_the_limit(shell) -> tuple[BaseException, float]:
    """``run_failing`` of the cell past ``LIMIT``, its report's fixes kept."""
    error, seconds = run_failing(shell, cell(f"--memory-limit {LIMIT}"))
    if (report := nbfsdp.last_run().out_of_memory) is not None:
        _fixes_past_the_limit.setdefault("fixes", report["fixes"])
    return error, seconds


@pytest.mark.floor
def test_over_its_limit_a_cpu_rank_fails_as_cuda_does_with_one_report(shell, model, capsys, cluster):
    pids = [info.pid for info in cluster.world.engines]
    capsys.readouterr()
    error, seconds = _run_past_the_limit(shell)
    print(f"the report {seconds:.2f} s after the cell began")
    assert isinstance(error, RankOutOfMemory), error
    assert "OutOfMemoryError: CPU out of memory. Tried to allocate " in str(error)  # CUDA's words
    assert "has a --memory-limit of 28.61 MiB of which " in str(error)
    report = nbfsdp.last_run().out_of_memory
    assert report is not None and not nbfsdp.last_run().ok
    assert report["limit"] == 30_000_000 and " in backward, in unit blocks." in report["doing"]
    # the planner's bytes where its trace passes the limit, against each rank's where it stopped: category by
    # category within 10% of the larger (or of 1% of the limit, for a category of a few bytes)
    planned = report["planned"]
    for rank, measured in report["measured"].items():
        for key in CATEGORIES:
            tolerance = max(0.10 * max(measured[key], planned[key]), 0.01 * report["limit"])
            assert abs(measured[key] - planned[key]) <= tolerance, (rank, key, measured[key], planned[key])
        assert sum(measured.values()) > 28.61 * 2**20  # past the limit: what ran out
    flags = [fix["flags"] for fix in report["fixes"]]
    assert "--mixed-precision PURE" in flags and "--world-size 4" in flags, flags
    assert all(fix["peak"] <= 0.9 * report["limit"] for fix in report["fixes"])
    shown = capsys.readouterr().out
    assert report["text"] in shown and "  comm_buffers " in shown and "These fit (under 90% of the limit" in shown
    assert '[rank 0]   File "<fsdp-cell-' in shown and "site-packages" not in shown  # the cell's line, not torch's
    # the world survives: the next cell runs on the same engines, no restart
    run_ok(shell, "%%fsdp --world-size 2\nafter = rank")
    assert [info.pid for info in cluster.world.engines] == pids


#: 16 MiB let go by the cell and dropped by another thread 5 ms later, as gloo's worker drops a finished
#: asynchronous gather's buffers; then 16 MiB more: past the limit (4 MiB of shards, 28.6 MiB) until that free lands.
FREED_ELSEWHERE = """%%fsdp --world-size 2 --wrap-cls Block --memory-limit 30MB
import threading, time
held, let_go = [torch.empty(16 * 2**20, dtype=torch.uint8)], threading.Event()
def drop_its_last_reference():
    let_go.wait(); time.sleep(0.005); held.clear()
worker = threading.Thread(target=drop_its_last_reference)
worker.start()
let_go.set()
second = torch.empty(16 * 2**20, dtype=torch.uint8)
worker.join()
dropped_first = not held and net is not None
"""


@pytest.mark.floor
def test_a_free_under_way_in_another_thread_is_not_counted_against_the_limit(shell, model):
    """Without the wait for it, the second tensor runs out: a rank at its limit would run out one allocation
    early, or not, by chance (seen as a report off the planner's by one buffer, once in 30 runs)."""
    run_ok(shell, FREED_ELSEWHERE)
    assert shell.user_ns["dropped_first"] is True


def test_every_fix_the_report_offers_fits_when_run(shell, model):
    if "fixes" not in _fixes_past_the_limit:
        _run_past_the_limit(shell)
    fixes = _fixes_past_the_limit["fixes"]
    assert len(fixes) >= 3, fixes
    for fix in fixes:
        words = fix["flags"].split(" (in the cell: ")
        micro = int(words[1].split("in ")[1].split(" micro")[0]) if len(words) > 1 else 1
        run_ok(shell, cell(f"--memory-limit {LIMIT} {words[0]}", micro))  # no OutOfMemoryError
        # the tracked steps' peaks (a captured step's also counts what the profiler saw allocated, and a buffer
        # gloo's thread frees is not seen freed: over the limit by 0.45 MB once, under load)
        peak = max(m["mem_peak"] for m in nbfsdp.last_run().metrics if "mem_captured_peak" not in m)
        assert peak <= 30_000_000, (fix, peak)


def test_a_limit_under_the_shards_alone_fails_before_the_first_operator(shell, model):
    error, _ = run_failing(shell, cell("--memory-limit 1MB"))
    assert isinstance(error, RankOutOfMemory) and "CPU out of memory" in str(error)
    report = nbfsdp.last_run().out_of_memory
    assert report["doing"] == "holding the model's shards, before the cell's first operator"
    assert report["measured"][0]["params"] > 4 * 2**20  # rank 0's shards of 2.1M fp32 parameters
    assert "Tried to allocate 4.01 MiB" in str(error)


def test_the_limit_is_a_size_given_as_a_flag_a_config_key_or_a_control(shell, model):
    with pytest.raises(UsageError, match="memory_limit must be a size such as 48MB, 512MiB or 2GiB; got 'lots'"):
        shell.run_cell_magic("fsdp", "--world-size 2 --memory-limit lots", "x = 1")
    assert resolve({"memory_limit": "512MiB"}, {}).memory_limit == 512 * 2**20
    assert resolve({"memory_limit": "512MiB"}, {"memory_limit": "1GB"}).memory_limit == 10**9  # the flag wins
    shell.user_ns["limits"] = {"memory_limit": "1MB"}
    error, _ = run_failing(shell, cell("--config limits"))
    assert isinstance(error, RankOutOfMemory)
    shell.run_line_magic("fsdp", "set memory_limit=1MB")  # what the panel's box does: the next cells' default
    try:
        error, _ = run_failing(shell, cell())
        assert isinstance(error, RankOutOfMemory)
        run_ok(shell, cell("--memory-limit 1GB"))  # a flag wins over the default
    finally:
        shell.run_line_magic("fsdp", "set memory_limit=none")
    changes = []
    controls = SettingsControls(
        {**dataclasses.asdict(resolve({}, {})), "world_size": 2, "memory_limit": 2**29}, changes.append
    )
    assert controls.widgets["memory_limit"].value == "512MiB" == size_words(512 * 2**20)
    controls.widgets["memory_limit"].value = "48MB"
    controls.widgets["memory_limit"].value = " "
    assert changes == [{"memory_limit": "48MB"}, {"memory_limit": None}]


def test_explain_judges_a_plan_against_the_memory_limit(shell, net, capsys):
    shell.user_ns["x"] = torch.empty(1024, 256, device="meta")
    capsys.readouterr()
    shell.run_line_magic("fsdp", "explain -n 2 --wrap-cls Block --memory-limit 30MB --batch x --suggest net")
    out = capsys.readouterr().out
    assert "on --memory-limit 28.6 MiB: does not fit (32.0 MiB of 28.6 MiB usable of 28.6 MiB)" in out
    assert "  PURE mixed precision: peak 23.0 MiB" in out


@gpu
def test_ranks_sharing_a_gpu_each_may_allocate_their_share_and_status_says_so(shell, capsys):
    """One rank more than there are GPUs: two ranks share GPU 0, and each may allocate half of it (the allocator's
    fraction); a --memory-limit sets the fraction to the limit instead."""
    world_size = torch.cuda.device_count() + 1
    read = "fraction = torch.cuda.get_per_process_memory_fraction(device)\nfractions = [None] * world_size\n"
    read += "torch.distributed.all_gather_object(fractions, fraction)"
    run_ok(shell, f"%%fsdp --device cuda --world-size {world_size}\n{read}")
    assert shell.user_ns["fractions"][0] == pytest.approx(0.5)
    assert shell.user_ns["fractions"][-1] == pytest.approx(0.5)  # the last rank is GPU 0's second
    capsys.readouterr()
    shell.run_line_magic("fsdp", "status")
    assert "GPU memory: each rank may allocate 1/2 of its GPU (2 ranks share one" in capsys.readouterr().out
    total = torch.cuda.get_device_properties(0).total_memory
    run_ok(shell, f"%%fsdp --device cuda --world-size {world_size} --memory-limit {total // 4}\n{read}")
    assert shell.user_ns["fractions"][0] == pytest.approx(0.25, abs=1e-3)


@gpu
def test_a_real_cuda_out_of_memory_is_reported_and_the_next_cell_runs(shell, model, cluster):
    """A rank that asks its GPU for more than its share meets CUDA's own error; the report names it and its
    bytes, the allocator is emptied, and the next cell runs on the same engines."""
    run_ok(shell, cell("--device cuda"))
    pids = [info.pid for info in cluster.world.engines]
    error, _ = run_failing(
        shell,
        "%%fsdp --device cuda --world-size 2\nhuge = torch.empty(int(torch.cuda.mem_get_info()[1]), device=device)",
    )
    assert isinstance(error, RankOutOfMemory) and "CUDA out of memory" in str(error), error
    report = nbfsdp.last_run().out_of_memory
    assert "its share of the GPU" in report["text"] and report["limit"] > 0
    run_ok(shell, "%%fsdp --device cuda --world-size 2\nreserved = torch.cuda.memory_reserved(device)")
    assert shell.user_ns["reserved"] < 2**30  # emptied: not the failed cell's blocks
    assert [info.pid for info in cluster.world.engines] == pids
