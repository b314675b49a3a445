"""Each private PyTorch API nbfsdp relies on (``nbfsdp.shared.torch_private``), called directly.

A PyTorch release that moves one fails here, by name. The FSDP2 ones run on real units, on the ranks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from nbfsdp.shared import torch_private
from tests.conftest import gpu, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]

ON_THE_RANKS = """%%fsdp --world-size 2 --wrap-cls Block --mixed-precision FULL --activation-checkpointing --no-gather
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from nbfsdp.shared import torch_private

weight = model.blocks[0].mlp[0].weight
shard_is_local = torch_private.local_tensor(weight).data_ptr() == weight.to_local().data_ptr()

x, y = batch_for(rank, 0)
out = model(x)
dtypes = [out.dtype]
loss_fn(out, y).backward()  # a whole step: every parameter sharded again, as between steps
bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
for module in model.modules():
    if hasattr(module, "_get_fsdp_state"):
        torch_private.set_mixed_precision(module, bf16)
dtypes.append(model(x).dtype)
del out

block = model.blocks[0]
gathered_after_forward = []
for reshard in (False, True):  # FULL_SHARD -> SHARD_GRAD_OP -> FULL_SHARD, as a live change does
    torch_private.set_reshard_after_forward(block, reshard=reshard)
    out = model(x)
    gathered_after_forward.append(not isinstance(block.mlp[0].weight, DTensor))
    loss_fn(out.float(), y).backward()
del out

checkpointing = [torch_private.checkpoint.state(block).enable_hook]
torch_private.set_checkpointing(block, enabled=False)
checkpointing.append(torch_private.checkpoint.state(block).enable_hook)

groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
torch_private.set_unshard_async_op(model, async_op=False)
async_off = [g.unshard_async_op for g in groups if g is not None]
# CPU ranks run so: a prefetched gather overlaps in gloo's thread
torch_private.set_unshard_async_op(model, async_op=True)
async_on = [g.unshard_async_op for g in groups if g is not None]
out = model(x)  # unsharded asynchronously, waited on in each unit's pre-forward: the same result
async_same = torch.equal(out, model(x))
loss_fn(out.float(), y).backward()  # a bf16 output against fp32 targets: torch 2.6's mse_loss backward needs one dtype
del out
"""


def test_fsdp2_internals_on_real_units(shell, tiny_model):
    run_ok(shell, ON_THE_RANKS)
    ns = shell.user_ns
    assert ns["shard_is_local"]
    assert ns["dtypes"] == [torch.float32, torch.bfloat16]  # the policy switched between two forwards
    assert ns["gathered_after_forward"] == [True, False]
    assert ns["checkpointing"] == [True, False]
    assert ns["async_off"] and not any(ns["async_off"]) and all(ns["async_on"]) and ns["async_same"]


def test_the_profilers_events_and_the_cpu_bytes_it_saw_allocated_at_once():
    """A profiled span's name, times and thread, read from the Kineto results, and the most CPU bytes allocated
    at once while profiling: 1 MiB and 2 MiB alive together, then both freed, then 1 MiB."""
    from torch.profiler import ProfilerActivity, profile, record_function

    before = torch.empty(2**20, dtype=torch.uint8)  # allocated before the profiler: neither counted nor its free

    def elsewhere() -> None:  # another thread's allocation: not the step's, as gloo's staging buffers are not
        torch.empty(8 * 2**20, dtype=torch.uint8).fill_(1)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler, record_function("nbfsdp::x"):
        a, b = torch.empty(2**20, dtype=torch.uint8), torch.empty(2 * 2**20, dtype=torch.uint8)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        del a, b, before
        c = torch.empty(2**20, dtype=torch.uint8)
    events, start_ns = torch_private.profiler_events(profiler)
    span = next(e for e in events if e[0] == "nbfsdp::x")
    assert start_ns <= span[1] < span[2] and not span[4]  # on the host
    assert all(e[0] != "[memory]" for e in events)
    assert torch_private.profiled_allocation_peak(profiler, {span[3]}) == 3 * 2**20
    assert torch_private.profiled_allocation_peak(profiler, set()) == 0
    del c


def test_saved_tensors_hooks_push_top_pop():
    def pack(t):
        return t

    def unpack(t):
        return t

    before = torch_private.top_saved_tensors_hooks()
    assert before is None or before is False
    torch_private.push_saved_tensors_hooks(pack, unpack)
    try:
        if before is not False:  # torch 2.8 on can tell
            assert torch_private.top_saved_tensors_hooks() == (pack, unpack)
    finally:
        torch_private.pop_saved_tensors_hooks()
    assert torch_private.top_saved_tensors_hooks() == before


def test_lr_scheduler_marks():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert torch_private.is_step_tracked(optimizer.step)  # LRScheduler wrapped it, with the mark nbfsdp reads

    def step():
        return None

    assert not torch_private.is_step_tracked(step)
    torch_private.mark_step_tracked(step)
    assert torch_private.is_step_tracked(step)
    optimizer.step = step
    torch_private.mark_optimizer_stepped(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    # neither "optimizer.step() has been overridden" nor "lr_scheduler.step() before optimizer.step()"
    assert not [w for w in caught if "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]


class _Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_loader_kind_and_infinite_sampler():
    assert torch_private.is_iterable_loader(DataLoader(_Numbers(), batch_size=2))
    assert not torch_private.is_iterable_loader(DataLoader(list(range(4)), batch_size=2))
    sampler = iter(torch_private.infinite_sampler())
    assert [next(sampler) for _ in range(3)] == [None, None, None]


def test_gradscalers_kernels_unscale_fp16_and_fp32_and_update_the_scale():
    """What ``nbfsdp.engines.scaling`` runs on the ranks' local shards, on the CPU (torch >= 2.3 has its kernels)."""
    grads = [torch.tensor([4.0, 8.0], dtype=torch.float16), torch.tensor([2.0, 6.0], dtype=torch.float16)]
    found_inf = torch.zeros(1)
    torch_private.unscale_and_check_(grads, found_inf, torch.full((1,), 0.5))
    assert [g.tolist() for g in grads] == [[2.0, 4.0], [1.0, 3.0]] and found_inf.item() == 0
    torch_private.unscale_and_check_([torch.tensor([1.0, float("nan")])], found_inf, torch.full((1,), 0.5))
    assert found_inf.item() == 1
    scale, tracker = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32)
    torch_private.update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2)  # an overflow backs off
    assert scale.item() == 2.0**15
    for _ in range(2):  # two clean steps grow it, at growth_interval 2
        torch_private.update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 2)
    assert scale.item() == 2.0**16


def test_cpu_attention_flop_formulas_count_the_cpu_flash_op_as_torch_counts_the_gpu_one():
    """The CPU's private flash op and its backward run under scaled_dot_product_attention on CPU, and get the GPU
    flash op's registered formulas: the attention's two matmuls forward, five backward (sdpa_flop_count)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from nbfsdp.course.meters import flop_counter

    formulas = torch_private.cpu_attention_flop_formulas()
    aten = torch.ops.aten
    cpu = [aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward]
    assert set(formulas) == set(cpu)
    shape = (2, 4, 32, 16)  # batch, heads, tokens, head width
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    forward, backward = sdpa_flop_count(shape, shape, shape), sdpa_backward_flop_count(shape, shape, shape, shape)
    assert forward == 2 * 2 * (2 * 4 * 32 * 32 * 16) and backward == 5 * forward // 2
    counted_by_us = {cpu[0]: forward, cpu[1]: backward}
    for counter, expected in ((FlopCounterMode(display=False), {}), (flop_counter(), counted_by_us)):
        with counter:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        counted = {op: n for op, n in counter.get_flop_counts().get("Global", {}).items() if "attention" in str(op)}
        assert counted == expected, counted  # torch alone: the CPU's attention is not counted at all


def test_dcp_load_in_one_process_reads_whole_tensors_with_no_process_group(tmp_path):
    """What the kernel does to read a checkpoint (export, ``%fsdp load``'s notebook side): no world."""
    import torch.distributed.checkpoint as dcp

    assert not torch.distributed.is_initialized()
    saved = {"models": {"m": {"weight": torch.arange(12.0).reshape(3, 4)}}, "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    state = {"models": {"m": {"weight": torch.zeros(3, 4)}}, "step": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it says nothing: one process is the point
        torch_private.dcp_load_in_one_process(state, dcp.FileSystemReader(str(tmp_path)))
    torch.testing.assert_close(state["models"]["m"]["weight"], saved["models"]["m"]["weight"], rtol=0, atol=0)
    assert state["step"] == 7


def test_a_store_on_a_socket_bound_to_loopback_serves_there_alone():
    """``store_on``: the server takes the socket it is given (libuv where this torch's takes a listen fd, the
    legacy server on torch 2.6), and a client reaches it; nothing else listens for it."""
    import datetime
    import socket

    import torch.distributed as dist

    from nbfsdp.shared.torch_private import store_on

    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.bind(("127.0.0.1", 0))
    listening.listen(8)
    port = listening.getsockname()[1]
    server = store_on(listening, 2, datetime.timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    client.set("key", "value")
    assert server.get("key") == b"value" and server.port == port


LIMITED = """%%fsdp --world-size 2 --wrap-cls Block --no-gather
from nbfsdp.shared import torch_private

asked = []
tracker = torch_private.limited_memory_tracker(model, lambda size, total: asked.append((size, total)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
with tracker:
    for step in range(2):  # a second iteration: FSDPMemTracker's own would refuse it without a reset
        x, y = batch_for(rank, step)
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
    during = tracker.doing
    held = tracker.by_category()
del tracker, opt
"""


def test_the_limited_memory_tracker_counts_by_category_and_calls_for_every_growth(shell, tiny_model):
    """FSDPMemTracker with its private methods overridden: each storage made or grown reports its size and the
    running total; the categories are the planner's; the optimizer's state is its own (global hooks)."""
    run_ok(shell, LIMITED)
    ns = shell.user_ns
    assert len(ns["asked"]) > 50 and all(size >= 0 and total >= size for size, total in ns["asked"])
    held = ns["held"]
    assert set(held) == {"params", "grads", "optim", "activations", "temporaries", "comm_buffers"}
    # AdamW: two fp32 moments the size of each shard, and a 4-byte step counter a parameter
    assert 0 < 2 * held["params"] <= held["optim"] < 2 * held["params"] + 256
    assert max(total for _, total in ns["asked"]) >= sum(held.values())
    assert ns["during"].endswith("in optimizer step") or " in " in ns["during"]


UNIT_STATES = """%%fsdp --world-size 2 --wrap-cls Block --no-gather
import datetime
from nbfsdp.shared import torch_private
seen = {}
def look(module, args):  # after FSDP's own pre-forward hook: the unit gathered
    seen["states"] = torch_private.fsdp_unit_states(model)
    seen["gathered"] = torch_private.gathered_from(model, module.mlp[0].weight)
    seen["not_gathered"] = torch_private.gathered_from(model, model.blocks[0].mlp[0].weight)
handle = model.blocks[1].register_forward_pre_hook(look)
out = model(batch_for(rank, 0)[0])
handle.remove()
during = {row["unit"]: (row["state"], row["training"]) for row in seen["states"]}
unit, sharded = seen["gathered"]
gathered = (unit, tuple(sharded.to_local().shape), seen["not_gathered"])
after = {row["unit"]: (row["state"], row["training"]) for row in torch_private.fsdp_unit_states(model)}
sizes = [(row["local_bytes"], row["full_bytes"]) for row in torch_private.fsdp_unit_states(model)]
lifted = torch_private.set_collective_timeout(datetime.timedelta(seconds=60))
"""


def test_each_units_state_and_a_gathered_parameters_shard_on_real_units(shell, tiny_model):
    """What ``nbfsdp.units`` and the ranks' debugger read (``nbfsdp.engines.debugging``), inside a unit's forward."""
    run_ok(shell, UNIT_STATES)
    ns = shell.user_ns
    assert ns["during"]["blocks.1"] == ("UNSHARDED", "FORWARD"), ns["during"]
    assert ns["during"]["blocks.0"][0] == "SHARDED" and ns["during"]["blocks.2"][0] == "SHARDED", ns["during"]
    # after forward the blocks are sharded again; the root stays gathered for the backward that comes next
    assert ns["after"].pop("(root)") == ("UNSHARDED", "IDLE")
    assert set(ns["after"].values()) == {("SHARDED", "IDLE")}, ns["after"]
    assert ns["gathered"] == ("blocks.1", (16, 16), None)  # its (32, 16) weight: half its rows here
    assert all(2 * local == full for local, full in ns["sizes"][1:]), ns["sizes"]
    assert ns["lifted"] is (torch.__version__ >= "2.7")


#: One of two gloo ranks with a 1 s timeout lifted to 60 s: rank 1 joins the all_reduce 2 s late. Each rank is a
#: process the test starts (``mp.spawn`` would add a third process importing torch, to start them).
LIFTED = """
import datetime, sys, time, torch, torch.distributed as dist
from nbfsdp.shared import torch_private
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=1))
torch_private.set_collective_timeout(datetime.timedelta(seconds=60))
if rank == 1:
    time.sleep(2)
total = torch.ones(1)
dist.all_reduce(total)
print(rank, total.item())
dist.destroy_process_group()
"""


def _two_ranks(script: str, store, timeout: float) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """``script`` run as ranks 0 and 1 (its arguments: the rank, the store's path): the processes and their
    stdout and stderr once both ended."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        return ranks, [process.communicate(timeout=timeout) for process in ranks]
    finally:
        for process in ranks:
            process.kill()  # one left waiting for a rank that failed; nothing, for one that ended


def test_a_lifted_collective_timeout_lets_a_late_rank_join(tmp_path):
    """``set_collective_timeout``: the collectives issued after it wait past the group's first timeout (torch 2.7+;
    on 2.6 gloo keeps the first one)."""
    if torch.__version__ < "2.7":
        pytest.skip("torch < 2.7: gloo keeps a group's first timeout")
    ranks, ended = _two_ranks(LIFTED, tmp_path / "store", timeout=60)
    for rank, (process, (_, stderr)) in enumerate(zip(ranks, ended, strict=True)):
        assert process.returncode == 0, f"rank {rank}: {stderr[-2000:]}"
    assert [stdout.strip() for stdout, _ in ended] == ["0 2.0", "1 2.0"], ended


#: Two gloo ranks of a world set up as nbfsdp's engines set one up, at a 1 s --timeout: rank 1 comes 4 s late to
#: the set-up, then 4 s late to the first all_reduce.
JOINS_LATE = """
import sys, time, torch, torch.distributed as dist
from nbfsdp.engines import engine
from nbfsdp.shared.protocol import WorldSetup
rank, store = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    time.sleep(4)
engine.setup(WorldSetup(rank=rank, world_size=2, backend="gloo", timeout=1.0, threads=1, generation=1,
                        store_path=store))
print(rank, "joined", flush=True)
if rank == 1:
    time.sleep(4)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
    print(rank, "reduced")
except Exception:
    print(rank, "failed after", round(time.monotonic() - started))
"""


def test_a_rank_late_to_a_new_world_joins_it_and_its_collectives_keep_the_timeout(tmp_path):
    """Seen beside a loaded suite: a new world's rank reached its set-up after --timeout's 30 s, and its peer's
    gloo set-up failed ("Wait timeout"). A world is joined within ``JOIN_TIMEOUT_SECONDS``, its collectives
    then given --timeout (torch 2.7+; on 2.6 gloo keeps a group's first timeout, so --timeout throughout)."""
    if not torch_private.collective_timeout_settable():
        pytest.skip("torch < 2.7: gloo keeps a group's first timeout")
    _, ended = _two_ranks(JOINS_LATE, tmp_path / "store", timeout=90)
    said = ended[0][0].split("\n")
    assert said[0] == "0 joined", ended  # 4 s late, past the 1 s --timeout
    assert said[1] in ("0 failed after 1", "0 failed after 2"), ended  # the all_reduce: --timeout, not the join's


def test_abort_nccl_communicators_finds_none_in_a_gloo_world_and_leaves_it_working(tmp_path):
    """The world's groups are walked (``_world.pg_names``, each one's CUDA backend): a gloo world has no NCCL
    communicator to abort (gloo's collectives are released by their connections, ``nbfsdp.engines.release``),
    so nothing happens to it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist.new_group([0])  # a second group, as a mesh makes
        assert torch_private.abort_nccl_communicators() is False
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
    finally:
        dist.destroy_process_group()


#: A one-rank gloo world with the flight recorder on, two collectives, then its entries as JSON: in a process of its
#: own, so that no process group an earlier test left in this one can hold it up; where it waits goes to stderr
#: before its 120 s. Its tensors stay referenced until the group is destroyed: on torch 2.6 and 2.7 the group's
#: destructor holds the GIL while it joins gloo's worker threads, and a worker dropping the last reference to a
#: collective's tensor takes the GIL to free its Python object (pytorch#56297; fixed in 2.8 by pytorch#154976).
#: Beside the suite that deadlocked this process in three fresh-clone floor runs (faulthandler, the third time: the
#: main thread in destroy_process_group, a GIL-waiting thread with no Python frame).
FLIGHTS = """
import faulthandler
faulthandler.dump_traceback_later(100, exit=True)
import json, sys, torch, torch.distributed as dist
from nbfsdp.shared import torch_private
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
reduced, broadcast = torch.ones(3), torch.ones(2, 2)
dist.all_reduce(reduced)
dist.broadcast(broadcast, src=0)
entries = torch_private.flight_recorder_entries()
dist.destroy_process_group()
keys = ("profiling_name", "input_sizes", "collective_seq_id", "state")
print(json.dumps([{key: entry.get(key) for key in keys} for entry in entries]))
"""


def test_the_flight_recorders_entries_of_a_gloo_world(tmp_path):
    """``_dump_fr_trace``'s pickle, read: each collective with its number, operation, sizes and state (torch 2.13
    records gloo too; a torch whose recorder is NCCL's only gives none on gloo)."""
    done = subprocess.run(
        [sys.executable, "-c", FLIGHTS, str(tmp_path / "store")],
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"},  # read as the process group is made
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    entries = json.loads(done.stdout.splitlines()[-1])
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        assert entries == []
        return
    assert [e["profiling_name"] for e in entries[-2:]] == ["gloo:all_reduce", "gloo:broadcast"]
    assert [e["input_sizes"] for e in entries[-2:]] == [[[3]], [[2, 2]]]
    assert entries[-1]["collective_seq_id"] == entries[-2]["collective_seq_id"] + 1
    assert entries[-1]["state"] is not None


def _rank_of_a_stuck_nccl_world(rank: int, directory: str, said: Any) -> None:
    """Rank 0 all-reduces alone (rank 1 never joins) until another thread aborts its communicators."""
    import threading
    import time

    import torch.distributed as dist

    os.environ["NCCL_HOSTID"] = f"nbfsdp-abort-test-{rank}"  # two ranks on one GPU: NCCL sees two hosts
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(f"{directory}/store", 2), rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    if rank == 1:
        said.put((rank, "joined once", 0.0))
        time.sleep(120)  # never joins the next
        return
    threading.Timer(1.0, torch_private.abort_nccl_communicators).start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    said.put((rank, "released", time.monotonic() - started))
    dist.destroy_process_group()
    said.put((rank, "destroyed", 0.0))


@gpu
def test_abort_nccl_communicators_releases_an_all_reduce_blocked_on_a_silent_peer(tmp_path):
    """From another thread, as a dead host's survivors do: the blocked all-reduce returns within seconds, and
    the process, and its group's teardown, live on (an attached cluster's engines are not nbfsdp's)."""
    context = multiprocessing.get_context("spawn")
    said = context.Queue()
    ranks = [context.Process(target=_rank_of_a_stuck_nccl_world, args=(r, str(tmp_path), said)) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        heard = {said.get(timeout=120)[1] for _ in range(3)}
        assert heard == {"joined once", "released", "destroyed"}, heard
    finally:
        for process in ranks:
            process.kill()
            process.join(10)


def test_a_dispatch_mode_sees_operators_by_name_and_is_paused_and_pytrees_round_trip():
    """What the planner's counter (``planning.live_bytes``) and the course's ``CommMeter`` are made of."""
    seen = []

    class Seen(torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(torch_private.operator_name(func))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2)
    with Seen():
        torch.add(x, x)
        with torch_private.paused_dispatch_mode():
            torch.mul(x, x)
        torch.sub(x, x)
    assert seen == ["aten::add", "aten::sub"]
    leaves, spec = torch_private.tree_flatten({"a": (x, 1), "b": [x]})
    assert len(leaves) == 3 and torch_private.tree_unflatten(leaves, spec)["a"][1] == 1
    doubled = torch_private.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, {"a": (x, "s")})
    assert doubled["a"][0].tolist() == [2.0, 2.0] and doubled["a"][1] == "s"


def test_apply_to_tensors_hands_each_parameter_and_buffer_the_given_tensor():
    """How the ranks adopt delivered shards without a copy (``sharding.adopt_shards``)."""
    model = torch.nn.BatchNorm1d(3, device="meta")
    made = {}

    def delivered(tensor: torch.Tensor) -> torch.Tensor:
        made[tuple(tensor.shape), tensor.dtype, len(made)] = fresh = torch.full(tensor.shape, 7, dtype=tensor.dtype)
        return fresh

    with torch.no_grad():
        torch_private.apply_to_tensors(model, delivered)
    assert isinstance(model.weight, torch.nn.Parameter) and not model.weight.is_meta
    pointers = {t.data_ptr() for t in made.values()}
    assert {t.data_ptr() for t in [*model.parameters(), *model.buffers()]} == pointers


def test_the_torch_2_6_patches_wait_for_the_engines_call_and_go_on_once():
    """Importing the module patches nothing; ``patch_fsdp2_for_torch_2_6`` does (torch 2.6: the CPU stream's
    event methods, FSDP2's copy-out wrapped once however many worlds are set up; from 2.7 torch has them)."""
    code = (
        "import torch, nbfsdp.shared.torch_private as tp\n"
        "stream = [hasattr(torch.cpu.Stream, 'record_event')]\n"
        "tp.patch_fsdp2_for_torch_2_6()\n"
        "import torch.distributed.fsdp._fully_shard._fsdp_collectives\n"
        "copy = torch.ops.fsdp.split_with_sizes_copy\n"
        "tp.patch_fsdp2_for_torch_2_6()\n"
        "print(stream + [hasattr(torch.cpu.Stream, 'record_event'), torch.ops.fsdp.split_with_sizes_copy is copy])"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before_2_7 = torch.__version__ < "2.7"
    assert printed.strip() == str([not before_2_7, True, True])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planners_attention_kernels_run_on_meta_tensors(dtype):
    """Each private attention op the planner's trace names (``nbfsdp.kernel.planning.torch_private``), called
    as the trace calls it, on meta tensors; and the CPU's choice among them, asked as the trace asks it."""
    from nbfsdp.kernel.planning import torch_private as kernels

    q, k, v = (torch.empty(2, 4, 32, 16, dtype=dtype, device="meta") for _ in range(3))
    mask = torch.zeros(1, 1, 32, 32, dtype=dtype, device="meta")
    outputs = [
        kernels.flash_attention(q, k, v, 0.0, is_causal=True, scale=None),
        kernels.efficient_attention(q, k, v, mask, 0.0, is_causal=False, scale=None),
        kernels.cpu_flash_attention(q, k, v, None, 0.0, is_causal=True, scale=None),
        kernels.math_attention(q, k, v, mask, 0.0, is_causal=False, scale=None),
    ]
    assert [tuple(o.shape) for o in outputs] == [(2, 4, 32, 16)] * 4
    assert kernels.cpu_picks_flash(q, k, None, is_causal=True) is True  # the CPU's flash kernel takes these


def test_a_modules_own_tensor_slots_read_set_and_copied_without_its_constructor():
    linear = torch.nn.Linear(3, 2, bias=False)  # its bias slot is None: reset_parameters reads it
    linear.register_buffer("kept", torch.ones(2))
    linear.register_buffer("scratch", torch.zeros(2), persistent=False)
    assert list(torch_private.own_parameters(linear)) == ["weight", "bias"] and linear.bias is None
    assert list(torch_private.own_buffers(linear)) == ["kept", "scratch"]
    assert torch_private.is_persistent_buffer(linear, "kept") and not torch_private.is_persistent_buffer(
        linear, "scratch"
    )
    torch_private.put_buffer(linear, "scratch", torch.full((2,), 7.0))  # its persistence kept
    assert not torch_private.is_persistent_buffer(linear, "scratch") and linear.scratch.tolist() == [7.0, 7.0]
    seen = []
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(lambda *a: seen.append(a))
    try:
        torch_private.put_parameter(linear, "weight", torch.nn.Parameter(torch.zeros(2, 3)))  # no hook, no check
    finally:
        handle.remove()
    assert not seen and linear.weight.sum() == 0
    parent = torch.nn.Sequential(linear)
    copy = torch_private.childless_copy(parent, {}, {})
    assert type(copy) is torch.nn.Sequential and len(copy) == 0 and len(parent) == 1
    made = torch_private.childless_copy(linear, {"weight": torch.nn.Parameter(torch.empty(2, 3)), "bias": None}, {})
    made.reset_parameters()  # its initializer runs on the copy alone
    assert made.weight.abs().sum() > 0 and linear.weight.sum() == 0 and made.bias is None


def test_a_tensors_write_count_and_view_base():
    tensor = torch.zeros(4)
    before = torch_private.version(tensor)
    tensor.add_(1)
    view = tensor[1:]
    assert torch_private.version(tensor) == before + 1
    assert torch_private.view_base(view) is tensor and torch_private.view_base(tensor) is None


def test_a_torch_function_replaced_while_inside_and_restored_however_it_ends():
    original = torch.Tensor.backward
    replacement = lambda *a, **k: "replaced"  # noqa: E731
    with (
        pytest.raises(RuntimeError, match="inside"),
        torch_private.replaced(torch.Tensor, "backward", replacement) as kept,
    ):
        assert kept is original and torch.ones(1).backward() == "replaced"
        raise RuntimeError("inside")
    assert torch.Tensor.backward is original
