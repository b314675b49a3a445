"""The course notebooks' shared parts, so each notebook shows only its own idea.

``models`` (the notebook and the ranks): the tiny GPT and MLP every notebook trains, their batches
and loss. ``meters`` (the ranks): what a rank measures inside a ``%%fsdp`` cell, the collectives it
runs and the parameters it holds gathered. ``timelines`` (the ranks): a from-scratch FSDP's step on
nbfsdp's timeline. ``diagrams`` (the notebook): the pictures drawn from numbers. ``keyboard`` (the
notebook): the lines a learner would type at the debugger's prompt, typed for them. ``ring_bytes`` is
the ring algorithms' bytes on the wire that ``%fsdp explain`` uses.
The notebooks import them by name::

    from nbfsdp.course import TinyGPT, batch_for, loss_fn, CommMeter

Objects from here reach the ranks by reference (the ranks import ``nbfsdp.course`` themselves). May import
``nbfsdp.shared`` only: nothing of the kernel's side, which the ranks do not have.
"""

from nbfsdp.course.diagrams import collective, strategy_timeline, timeline
from nbfsdp.course.keyboard import typed
from nbfsdp.course.meters import CollectiveMeter, CommMeter, peer_connections, tcp_counters, traffic, unsharded_bytes
from nbfsdp.course.models import MLP, Block, MLPBlock, TinyGPT, batch_for, loss_fn, rotation_batch
from nbfsdp.course.timelines import captured_step, fsdp_span
from nbfsdp.shared.collectives import ring_bytes

__all__ = [
    "MLP",
    "Block",
    "CollectiveMeter",
    "CommMeter",
    "MLPBlock",
    "TinyGPT",
    "batch_for",
    "captured_step",
    "collective",
    "fsdp_span",
    "loss_fn",
    "peer_connections",
    "ring_bytes",
    "rotation_batch",
    "strategy_timeline",
    "tcp_counters",
    "timeline",
    "traffic",
    "typed",
    "unsharded_bytes",
]
