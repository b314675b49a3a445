"""A deep stack of identical layers traced in a few: the planner records a copy of the model cut to ``3p`` layers
and to ``4p`` (``p`` the stack's period: 1, or 2 where every 2nd layer is checkpointed), and repeats a middle
block's events to the full depth. Runs in the notebook's kernel.

Tracing Llama-3-70B's 80 layers on the meta device takes seconds; ``--suggest`` traces a dozen settings. The
layers of a stack do the same operators on tensors of the same shapes, so a layer's events are the previous
layer's, named one layer on, with the bytes the layers before it keep (their activations) added: one more layer
adds the same events and the same bytes wherever it is inserted. That is checked, not assumed: the ``3p``
recording stretched by one block must equal the ``4p`` recording, event for event and byte for byte; where it
does not (a model whose layers differ, or whose forward depends on their number), the whole model is traced.

A recording's regions (``_Regions``): before the stack's forward, the forward of each block of ``p`` layers, what
runs between the stack's forward and its backward (the head, the loss), the backward of each block (last block
first), and what follows. Stretching by ``m`` blocks repeats block 1's forward and backward ``m`` times
(renaming their layers ``p``, ``2p``... on), renames the layers after it ``m * p`` on, and adds to every event
between block 1's forward and its backward the bytes of the ``m`` blocks added.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from nbfsdp.kernel.planning.recording import Event, Recording, Ref, Split
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.units import activation_modules, wrap_units

#: Lists shorter than this are not looked at as stacks.
MIN_LAYERS = 8


@dataclass(frozen=True, slots=True)
class Stack:
    """The model's longest stack of identical layers (a ``ModuleList`` or ``Sequential`` of FSDP units)."""

    path: str
    """Its name in the model, e.g. ``model.layers``."""
    length: int
    period: int
    """Layers repeat with this period (2 where every 2nd layer is checkpointed)."""

    def cuts(self) -> tuple[int, int, int] | None:
        """The depths recorded (``3p``, ``4p`` and ``5p``), or None where the stack is too short to gain by it."""
        cuts = (3 * self.period, 4 * self.period, 5 * self.period)
        return cuts if self.length >= 2 * sum(cuts) else None  # at least twice as fast as the whole stack


def find_stack(model: nn.Module, config: FSDPConfig) -> Stack | None:
    """The longest ``ModuleList`` or ``Sequential`` of layers that each are an FSDP unit (or hold units), alike in
    their parameters, buffers, the units inside them and what is checkpointed, with a period of 1 or 2; None
    where there is none."""
    units = wrap_units(model, config)
    unit_ids = {id(u) for u in units}
    checkpointed = {id(m) for m in activation_modules(model, units, config)}
    best: Stack | None = None
    for path, module in model.named_modules():
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) < MIN_LAYERS:
            continue
        signatures = [_signature(layer, unit_ids, checkpointed) for layer in module]
        if not signatures[0][3]:  # no unit inside: the layers are not sharded one by one
            continue
        period = next((p for p in (1, 2) if all(s == signatures[i % p] for i, s in enumerate(signatures))), None)
        if period is not None and (best is None or len(module) > best.length):
            best = Stack(path, len(module), period)
    return best


def _signature(layer: nn.Module, units: set[int], checkpointed: set[int]) -> tuple:
    return (
        type(layer),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
        tuple(n for n, m in layer.named_modules() if id(m) in units),
        tuple(n for n, m in layer.named_modules() if id(m) in checkpointed),
    )


def cut(model: nn.Module, stack: Stack, layers: int) -> nn.Module:
    """A meta copy of ``model`` (as ``transfer.meta_copy`` makes one) with its stack cut to its first ``layers``
    layers; the rest is never copied."""
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    full = model.get_submodule(stack.path)
    kept = [copy.deepcopy(layer, memo) for layer in list(full.children())[:layers]]
    memo[id(full)] = nn.Sequential(*kept) if type(full) is nn.Sequential else nn.ModuleList(kept)
    return copy.deepcopy(model, memo)


@dataclass(frozen=True, slots=True)
class _Regions:
    """Where a recording's parts lie: ``forward[b]`` and ``backward[b]`` are block ``b``'s spans of events."""

    forward: list[tuple[int, int]]
    backward: list[tuple[int, int]]


def _regions(events: list[Event], blocks: int, period: int) -> _Regions | None:
    """Each block's forward and backward span: from the hook that enters its first layer to the hook that enters
    the next unit in that pass; None where the blocks do not come in order, each once a pass."""
    entries: list[tuple[int, str, int]] = []  # (position, pass, layer or -1)
    for position, event in enumerate(events):
        if event[0] in ("pre_forward", "pre_backward"):
            entries.append((position, event[0], event[1][0]))
    spans: dict[str, list[tuple[int, int]]] = {"pre_forward": [], "pre_backward": []}
    for kind in spans:
        marks = [(position, layer) for position, pass_, layer in entries if pass_ == kind]
        # a block's span starts where its layers' run starts and ends where the next run of another block starts
        runs: list[tuple[int, int, int]] = []  # (block, start, end)
        for index, (position, layer) in enumerate(marks):
            block = layer // period if layer >= 0 else -1
            end = marks[index + 1][0] if index + 1 < len(marks) else len(events)
            if runs and runs[-1][0] == block:
                runs[-1] = (block, runs[-1][1], end)
            else:
                runs.append((block, position, end))
        blocks_seen = [run for run in runs if run[0] >= 0]
        expected = list(range(blocks)) if kind == "pre_forward" else list(range(blocks - 1, -1, -1))
        if [run[0] for run in blocks_seen] != expected:
            return None
        ordered = sorted(blocks_seen)
        spans[kind] = [(start, end) for _, start, end in ordered]
    return _Regions(spans["pre_forward"], spans["pre_backward"])


def _moved(event: Event, rename: Callable[[int], int], added: Split) -> Event:
    """``event`` with its unit's layer renamed and ``added`` live bytes."""

    def ref(r: Ref) -> Ref:
        return (rename(r[0]), r[1]) if r[0] >= 0 else r

    def plus(split: Split) -> Split:
        return split[0] + added[0], split[1] + added[1], split[2] + added[2]

    kind = event[0]
    if kind == "live":
        return ("live", *plus(event[1:]))
    if kind in ("pre_forward", "pre_backward"):
        return kind, ref(event[1]), plus(event[2])
    if kind == "reduce":
        return kind, ref(event[1]), plus(event[2]), plus(event[3])
    if kind in ("where", "post_forward"):
        return kind, ref(event[1])
    return event


def _live(event: Event) -> Split:
    """The live bytes an event carries ((0, 0, 0) for one that carries none)."""
    kind = event[0]
    if kind == "live":
        return event[1:]
    if kind in ("pre_forward", "pre_backward", "reduce"):
        return event[2]
    return (0, 0, 0)


@dataclass(frozen=True, slots=True)
class _Parts:
    """A ``3p`` recording in the parts stretching treats apart, and what one more block adds to each event."""

    head: list[Event]
    """Up to the end of block 1's forward."""
    forward: list[Event]
    """Block 1's forward: repeated."""
    middle: list[Event]
    """From the end of block 1's forward to the start of its backward: its layers renamed on."""
    backward: list[Event]
    """Block 1's backward: repeated."""
    tail: list[Event]
    """From the start of block 1's backward on."""
    added: dict[str, list[Split]]
    """By part (``forward``, ``middle``, ``backward``, ``tail``), the live bytes each event gains with each block
    (in the tail, what the layers above keep until their own backward is over: a checkpoint's saved input)."""
    period: int

    def stretched(self, blocks: int) -> list[Event]:
        """The recording with ``blocks`` more blocks after block 1."""
        p, layers = self.period, blocks * self.period
        out = list(self.head)
        for m in range(1, blocks + 1):
            out += [
                _moved(e, _on(m * p), _times(a, m)) for e, a in zip(self.forward, self.added["forward"], strict=True)
            ]
        out += [
            _moved(e, lambda j: j + layers if j >= 2 * p else j, _times(a, blocks))
            for e, a in zip(self.middle, self.added["middle"], strict=True)
        ]
        # a repeat's backward has m blocks below it (their activations) and blocks - m above it (what they keep
        # until their own backward is over, as block 1's own backward gains in the tail)
        above = self.added["tail"][: len(self.backward)]
        for m in range(blocks, 0, -1):
            out += [
                _moved(e, _on(m * p), _plus(_times(a, m), _times(b, blocks - m)))
                for e, a, b in zip(self.backward, self.added["backward"], above, strict=True)
            ]
        # block 1's own backward and after: the block above it is the first repeat
        return out + [_moved(e, _on(0), _times(a, blocks)) for e, a in zip(self.tail, self.added["tail"], strict=True)]


def _on(layers: int) -> Callable[[int], int]:
    """Layer ``j`` named ``layers`` layers on."""
    return lambda j: j + layers


def _minus(a: Split, b: Split) -> Split:
    return a[0] - b[0], a[1] - b[1], a[2] - b[2]


def _times(split: Split, times: int) -> Split:
    return split[0] * times, split[1] * times, split[2] * times


def _plus(a: Split, b: Split) -> Split:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _parts(short: list[Event], long: list[Event], period: int) -> _Parts | None:
    """``short`` (``3p`` layers) in parts, each event's gain per block read from ``long`` (``4p``); None where
    ``long`` is not ``short`` with one block more in that shape (other events, or other units)."""
    regions = _regions(short, 3, period)
    if regions is None or len(long) != len(short) + sum(b - a for a, b in (regions.forward[1], regions.backward[1])):
        return None
    (f_start, f_end), (b_start, b_end) = regions.forward[1], regions.backward[1]
    forward, middle, backward = short[f_start:f_end], short[f_end:b_start], short[b_start:b_end]
    if long[:f_end] != short[:f_end]:  # before block 2, nothing can depend on the layers after it
        return None
    tail = short[b_start:]
    after_block_2 = lambda j: j + period if j >= 2 * period else j  # noqa: E731
    expected = {  # each part as ``long`` has it, less the bytes; where ``long`` has it
        "forward": ([_moved(e, _on(period), (0, 0, 0)) for e in forward], f_end),
        "middle": ([_moved(e, after_block_2, (0, 0, 0)) for e in middle], f_end + len(forward)),
        "backward": (
            [_moved(e, lambda j: j + period, (0, 0, 0)) for e in backward],
            f_end + len(forward) + len(middle),
        ),
        "tail": (tail, len(long) - len(tail)),
    }
    added: dict[str, list[Split]] = {}
    for part, (events, at) in expected.items():
        gains = []
        for event, seen in zip(events, long[at : at + len(events)], strict=True):
            gain = _minus(_live(seen), _live(event))
            if _moved(event, _on(0), gain) != seen:  # another event, or another unit
                return None
            gains.append(gain)
        added[part] = gains
    return _Parts(short[:f_end], forward, middle, backward, tail, added, period)


def stretched(recordings: list[Recording], stack: Stack) -> Recording | None:
    """The full stack's events from its ``3p``, ``4p`` and ``5p`` recordings: the ``3p`` one stretched by the
    gains ``4p`` shows, checked against ``5p`` (two blocks more); None where they differ (the layers are not
    alike enough to be repeated, or the model's forward depends on their number)."""
    short, long, check = recordings
    parts = _parts(short.events, long.events, stack.period)
    if parts is None or not short.end == long.end == check.end or parts.stretched(2) != check.events:
        return None
    return Recording(parts.stretched((stack.length - 3 * stack.period) // stack.period), short.end)
