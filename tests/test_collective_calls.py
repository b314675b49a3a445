"""One wrapper of ``torch.distributed``'s collectives (``shared.collective_calls``) for the ranks' ledger of
collectives and the course's ``CollectiveMeter``: neither wraps the other's wrapper, both see each call.

Run in a fresh process with a one-rank gloo world, so that the wrappers stay out of the test process."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys, threading, torch, torch.distributed as dist
from nbfsdp.course.meters import CollectiveMeter
from nbfsdp.engines import where
from nbfsdp.shared import collective_calls

original = dist.all_reduce
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
where.watch(None, 0)  # as engine.setup does: the ledger watches from the world's start
wrapper = dist.all_reduce
with CollectiveMeter() as meter:
    dist.all_reduce(torch.ones(4))  # the cell's line
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, torch.ones(4))
after = dist.all_reduce


class Asks:
    \"\"\"Asks, from another thread, where the main thread is while it is inside a collective.\"\"\"
    def entered(self, name, function, args, kwargs):
        asking = threading.Thread(target=lambda: answers.append(where.answer_of(threading.main_thread().ident)))
        asking.start()
        asking.join()

    def left(self, token):
        pass


answers, walked = [], []
getframe = sys._getframe
sys._getframe = lambda depth=0: walked.append(depth) or getframe(depth + 1)
collective_calls.watch(Asks())
dist.all_reduce(torch.ones(2))  # the meter has stopped; the ledger has not
sys._getframe = getframe
ledger = where.ledger.as_dict()
print(json.dumps({
    "one_wrapper": wrapper is after and wrapper.__wrapped__ is original,
    "meter": meter.calls,
    "ledger": [e["op"] for g in ledger["groups"] for e in g["recent"]],
    "walked": len(walked),
    "at": answers[0]["ledger"]["inside"]["at"],
    "not_inside": where.answer_of(threading.main_thread().ident)["ledger"]["inside"],
}))
dist.destroy_process_group()
"""


def test_the_ledger_and_the_meter_watch_one_wrapper():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["one_wrapper"]  # the meter put no wrapper of its own over the ledger's
    assert seen["meter"] == [["all_reduce", 16, 1], ["all_gather", 16, 1]]
    assert seen["ledger"] == ["all_reduce", "all_gather_into_tensor", "all_reduce"]
    assert seen["walked"] == 0  # a collective walks no frame: the line is read when asked
    issued = PROGRAM.splitlines().index("dist.all_reduce(torch.ones(2))  # the meter has stopped; the ledger has not")
    assert seen["at"] == f"<string>:{issued + 1} in <module>"  # the line that issued it, read from the waiting stack
    assert seen["not_inside"] is None


P2P_PROGRAM = """
import json, torch, torch.distributed as dist
from nbfsdp.shared import collective_calls

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
collective_calls.watch(type("Nobody", (), {"entered": lambda *a: None, "left": lambda *a: None})())
ops = [dist.P2POp(dist.isend, torch.ones(1), 0), dist.P2POp(dist.irecv, torch.ones(1), 0)]  # as pipelining makes them
same = [name for name in collective_calls.COLLECTIVES
        if getattr(dist, name, None) is getattr(dist.distributed_c10d, name, None)]
print(json.dumps({"ops": len(ops), "same": same, "wrapped": dist.isend.__wrapped_by_nbfsdp__}))
dist.destroy_process_group()
"""


def test_each_collective_has_one_wrapper_on_both_modules_so_pipelining_can_send():
    """torch.distributed.pipelining makes ``P2POp(dist.isend, ...)``, and P2POp takes only distributed_c10d's
    isend or irecv: with a wrapper of each module's own, every pipeline stage's first send raised."""
    done = subprocess.run([sys.executable, "-c", P2P_PROGRAM], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["ops"] == 2 and seen["wrapped"]
    assert set(seen["same"]) >= {"isend", "irecv", "send", "recv", "all_reduce", "all_gather_into_tensor"}
