"""Which modules become FSDP units, and which rule chose them.

Runs in the notebook's kernel (``%fsdp explain``, the checks before a cell
runs) and on the engines (``nbfsdp.engines.sharding.apply_fsdp``), on the
same model, so both choose the same units, and the same modules to checkpoint
(``activation_modules``: where a module's ``_activation_checkpointing``
attribute says, else where the root's ``activation_checkpointing_fn(module)``
says, else on every non-root unit).

Composer's rules, in its order. A module is its own FSDP unit when its
``_fsdp_wrap`` attribute says so; otherwise when the root's
``fsdp_wrap_fn(module)`` is true, its class is in ``wrap_cls`` (TorchAcc), or
it holds at least ``min_params`` parameters not already in a unit below it.
When none of the first three is given, the classes the model names in
``_no_split_modules`` (Hugging Face's attribute, read on the root and on the
models inside it, as Accelerate does) are the wrap classes. The root is always
a unit. nbfsdp never imports transformers: the attribute is read as it is.

FSDP2 (torch 2.13) refuses a parameter that two units share. A rule the user
gives that puts the names of one tied parameter (GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``) in two units is refused here, before anything runs.
The default rules (``_no_split_modules``, ``min_params``) leave such a unit out
instead, so the tie stays in its names' common parent's unit (a BERT's
``BertEmbeddings``, whose word embeddings are its decoder's weight), and
``ties_kept`` says so (``%fsdp explain``, and a line before a cell).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from nbfsdp.shared import peft_private, torch_private
from nbfsdp.shared.config import ConfigError, FSDPConfig

#: Containers without a forward of their own: FSDP2 cannot make them units (FSDP1's size policy,
#: which Composer's min_params used, skipped them too and counted their parameters in the parent).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)

#: How ``%fsdp explain`` names each rule that can choose units.
_SOURCES = {
    "_fsdp_wrap": "the modules' _fsdp_wrap attributes",
    "fsdp_wrap_fn": "the root's fsdp_wrap_fn",
    "wrap_cls": "wrap_cls",
    "_no_split_modules": "the model's _no_split_modules (Accelerate's convention)",
}


def root_method(model: nn.Module, name: str) -> Callable[[nn.Module], object] | None:
    method = getattr(model, name, None)
    return method if callable(method) else None


@dataclass(frozen=True, slots=True)
class WrapRule:
    """The rules that choose a model's units besides ``min_params``, which always applies."""

    wrap_cls: tuple[str, ...]
    """The wrap classes in force: the config's ``wrap_cls``, else the model's ``_no_split_modules``."""
    sources: tuple[str, ...]
    """Which rules are given: ``_fsdp_wrap``, ``fsdp_wrap_fn``, ``wrap_cls``, or ``_no_split_modules`` alone."""

    @property
    def explicit(self) -> bool:
        """The user chose the units (``_fsdp_wrap``, ``fsdp_wrap_fn``, ``wrap_cls``), not the model's defaults."""
        return bool(set(self.sources) - {"_no_split_modules"})

    def __str__(self) -> str:
        if not self.sources:
            return "from min_params alone (Composer's FSDP1 size rule; its FSDP2 path has none)"
        return "from " + " and ".join(_SOURCES[source] for source in self.sources)

    def as_dict(self) -> dict[str, object]:
        """For ``Plan`` and ``last_run().config``: the classes and where they came from."""
        return {"wrap_cls": list(self.wrap_cls), "source": ", ".join(self.sources) or "min_params", "rule": str(self)}


def _no_split_classes(model: nn.Module) -> tuple[str, ...]:
    """Class names in ``_no_split_modules`` (a list or set) on ``model`` or any module inside it."""
    names: dict[str, None] = {}
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(dict.fromkeys(sorted(str(name) for name in declared)))
    return tuple(names)


def wrap_rule(model: nn.Module, config: FSDPConfig) -> WrapRule:
    """The rule in force: an explicit one (``_fsdp_wrap``, ``fsdp_wrap_fn``, ``wrap_cls``) wins over the model's."""
    explicit = (
        ("_fsdp_wrap", any(hasattr(m, "_fsdp_wrap") for m in model.modules() if m is not model)),
        ("fsdp_wrap_fn", root_method(model, "fsdp_wrap_fn") is not None),
        ("wrap_cls", bool(config.wrap_cls)),
    )
    sources = tuple(name for name, given in explicit if given)
    if sources:
        return WrapRule(config.wrap_cls, sources)
    declared = _no_split_classes(model)
    return WrapRule(declared, ("_no_split_modules",) if declared else ())


def wrap_units(model: nn.Module, config: FSDPConfig) -> list[nn.Module]:
    """The non-root units in post-order (a unit's descendants come before it).

    Raises ``ConfigError`` when a rule picks a container that FSDP2 cannot shard,
    or a rule the user gave splits a tied parameter between units (a default rule
    leaves the unit out: ``ties_kept``). A unit whose trainable parameters are stored in several dtypes is
    split (``split_by_dtype``).
    """
    return split_by_dtype(model, _units_and_ties(model, config)[0])[0]


def wrap_key(config: FSDPConfig) -> tuple:
    """What ``wrap_units`` and ``activation_modules`` read of ``config``: the same model under two configs of one
    key has the same units and checkpoints (the planner's trace cache keys its recordings by it)."""
    return (
        config.wrap_cls,
        config.min_params,
        config.activation_checkpointing,
        config.activation_cpu_offload,
        config.checkpoint_every,
        config.checkpoint_scope,
    )


def dtype_splits(model: nn.Module, config: FSDPConfig) -> list[str]:
    """The units split because their trainable parameters are stored in several dtypes: one line each, naming
    the modules made units of their own and why (``split_by_dtype``)."""
    return split_by_dtype(model, _units_and_ties(model, config)[0])[1]


def split_by_dtype(model: nn.Module, units: list[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """``units`` (and the root) with each one whose trainable parameters are stored in several dtypes split
    into one unit per dtype, and one line per split unit saying so.

    FSDP2 (torch 2.13) all-gathers and reduces a unit's parameters as one group, and asserts that its trainable
    ones share one original dtype ("FSDP expects uniform original parameter dtype", pytorch#156784); frozen ones
    may differ. The workaround the PyTorch forum and NeMo use keeps each parameter's dtype, so one process's math:
    inside the unit, the outermost modules whose trainable parameters are all of a dtype other than the unit's
    most common one (by elements) become units of their own (fp32 norms beside bf16 linears). A module whose own
    parameters mix trainable dtypes cannot be split so: ``ConfigError`` names it and the ways out.
    """
    unit_ids = {id(u) for u in units}
    names = {id(m): n for n, m in model.named_modules()}
    added: list[nn.Module] = []
    notes: list[str] = []
    for unit in [*units, model]:
        members = _members(unit, unit_ids)
        counts: dict = {}
        for module in members:
            for param in _trainable(module):
                counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
        if len(counts) < 2:
            continue
        main = max(counts, key=lambda dtype: counts[dtype])
        chosen: list[nn.Module] = []
        inside: set[int] = set()
        for module in members:
            if id(module) in inside or module is unit:
                continue
            dtypes = {p.dtype for m in _members(module, unit_ids) for p in _trainable(m)}
            if len(dtypes) == 1 and main not in dtypes and not isinstance(module, _CONTAINERS):
                chosen.append(module)
                inside.update(id(m) for m in module.modules())
        for module in members:
            own = {p.dtype for p in _trainable(module)}
            if id(module) not in inside and own - {main}:
                raise ConfigError(
                    f"{names[id(module)] or 'the root'} ({type(module).__name__}) holds trainable parameters "
                    f"stored in {_dtype_list(own | {main})} in one FSDP unit, and FSDP2 needs one dtype among a "
                    "unit's trainable parameters (pytorch#156784): store them in one dtype, freeze the odd ones, or "
                    "move them into a module of their own"
                )
        added += chosen
        split = ", ".join(names[id(m)] for m in chosen)
        notes.append(
            f"{names[id(unit)] or 'the root'} is split by dtype: its trainable parameters are stored in "
            f"{_dtype_list(set(counts))}, and FSDP2 needs one dtype a unit; {split} "
            f"({_dtype_list({p.dtype for m in chosen for p in _trainable(m, recurse=True)})}) "
            f"{'is a unit' if len(chosen) == 1 else 'are units'} of {'its' if len(chosen) == 1 else 'their'} own"
        )
    if not added:
        return units, notes
    chosen_ids = unit_ids | {id(m) for m in added}
    ordered = {id(m): m for m in _post_order(model) if id(m) in chosen_ids and m is not model}  # a shared one once
    return list(ordered.values()), notes


def _trainable(module: nn.Module, *, recurse: bool = False) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=recurse) if p.requires_grad and p.is_floating_point()]


def _members(unit: nn.Module, unit_ids: set[int]) -> list[nn.Module]:
    """The modules whose own parameters ``unit`` takes: itself and its descendants outside the units inside it,
    in pre-order."""
    found = [unit]
    for child in unit.children():
        if id(child) not in unit_ids:
            found += _members(child, unit_ids)
    return found


def _post_order(module: nn.Module) -> list[nn.Module]:
    return [m for child in module.children() for m in _post_order(child)] + [module]


def _dtype_list(dtypes: set) -> str:
    return " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def ties_kept(model: nn.Module, config: FSDPConfig) -> list[str]:
    """The units a default rule would have made that split a tied parameter, left out so that the tie stays in
    its common parent's unit: one line each, naming the module, the tie and where it stays."""
    return _units_and_ties(model, config)[1]


def _units_and_ties(model: nn.Module, config: FSDPConfig) -> tuple[list[nn.Module], list[str]]:
    wrap_fn = root_method(model, "fsdp_wrap_fn")
    rule = wrap_rule(model, config)
    units: list[nn.Module] = []

    def unwrapped_params(name: str, module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(
            unwrapped_params(f"{name}.{key}" if name else key, child) for key, child in module.named_children()
        )
        if module is model or count == 0:
            return count
        if hasattr(module, "_fsdp_wrap"):
            chosen = bool(module._fsdp_wrap)
        else:
            chosen = bool(wrap_fn and wrap_fn(module)) or type(module).__name__ in rule.wrap_cls
        if isinstance(module, _CONTAINERS):
            if chosen:
                raise ConfigError(
                    f"{name} ({type(module).__name__}) has no forward, so FSDP2 cannot make it a unit; "
                    "choose its elements instead (--wrap-cls, _fsdp_wrap or fsdp_wrap_fn)"
                )
            return count
        if chosen or count >= config.min_params:
            units.append(module)
            return 0
        return count

    unwrapped_params("", model)
    notes: list[str] = []
    while (split := _split_tie(model, units)) is not None:
        fqns, apart, keeper = split
        if rule.explicit:
            classes = sorted({type(model.get_submodule(u)).__name__ for u in apart})
            raise ConfigError(
                f"{' and '.join(fqns)} are one tied parameter, but {', '.join(apart)} is a unit of its own "
                f"({rule}), and FSDP2 cannot share a parameter between units: change the rule so that "
                f"{', '.join(apart)} is not a unit (with --wrap-cls, leave out {', '.join(classes)}) and the tie "
                f"stays in {keeper or 'the root'}"
            )
        left_out = {id(model.get_submodule(path)) for path in apart}
        units = [unit for unit in units if id(unit) not in left_out]
        notes += [
            f"{type(model.get_submodule(path)).__name__} {path} is not a unit: {' and '.join(fqns)} are one tied "
            f"parameter (FSDP2 cannot share one between units), kept in {keeper or 'the root'}"
            for path in apart
        ]
    return units, notes


def _split_tie(model: nn.Module, units: list[nn.Module]) -> tuple[list[str], list[str], str] | None:
    """The first tied parameter whose names fall in different units: its names, the units that hold a name
    apart from their common parent's unit, and that unit ('' the root). None where every tie is whole."""
    unit_ids = {id(u) for u in units}
    unit_names = {name for name, module in model.named_modules() if id(module) in unit_ids} | {""}
    names_of: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(fqn)

    def owner(path: str) -> str:
        """The innermost unit holding the module at ``path``: '' is the root."""
        while path not in unit_names:
            path = path.rpartition(".")[0]
        return path

    for fqns in names_of.values():
        if len(fqns) < 2:  # not tied
            continue
        paths = [fqn.rpartition(".")[0] for fqn in fqns]
        if len({owner(path) for path in paths}) < 2:
            continue
        keeper = owner(".".join(_common_prefix([path.split(".") for path in paths])))
        return fqns, sorted({owner(path) for path in paths} - {keeper}), keeper
    return None


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        prefix.append(parts[0])
    return prefix


def forward_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The root, then the other units in the order the model registers them (``model.modules()``): the order
    forward reaches them in a model that calls its units as it lists them (Hugging Face's, torchtitan's), which
    nbfsdp assumes rather than traces; forward prefetch follows it."""
    unit_ids = {id(u) for u in units}
    return [model, *(m for m in model.modules() if id(m) in unit_ids)]


def activation_modules(model: nn.Module, units: list[nn.Module], config: FSDPConfig) -> list[nn.Module]:
    """Where activation checkpointing and activation CPU offload apply, by Composer's rules.

    Outermost choices only: a checkpoint nested in another would recompute twice.
    """
    if not (config.activation_checkpointing or config.activation_cpu_offload):
        return []
    choose = root_method(model, "activation_checkpointing_fn")
    unit_ids = {id(u) for u in units}
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside:
            continue
        if hasattr(module, "_activation_checkpointing"):
            selected = bool(module._activation_checkpointing)
        elif choose is not None:
            selected = bool(choose(module))
        else:
            selected = id(module) in unit_ids
        if selected:
            chosen.append(module)
            inside.update(id(m) for m in module.modules())
    chosen = chosen[:: config.checkpoint_every]
    if config.checkpoint_scope == "attention":
        return [_attention_of(model, block) for block in chosen]
    return chosen


def _attention_of(model: nn.Module, block: nn.Module) -> nn.Module:
    """The outermost submodule of ``block`` whose class name says attention (``checkpoint_scope`` attention)."""
    for module in block.modules():
        if module is not block and re.search(r"attention|attn", type(module).__name__, re.IGNORECASE):
            return module
    names = {id(m): n for n, m in model.named_modules()}
    raise ConfigError(
        f"checkpoint_scope attention: {names[id(block)] or 'the root'} ({type(block).__name__}) has no submodule "
        "whose class name has Attention or Attn; use checkpoint_scope block"
    )


def init_function(root: nn.Module, name: str) -> Callable[[nn.Module], object] | None:
    """What initializes the own tensors of ``root``'s module ``name`` on the ranks (``initializing.materialize``),
    or None: the root's ``param_init_fn(module)``; else the ``_init_weights(module)`` of the nearest Hugging Face
    model holding it (as transformers' ``smart_apply`` dispatches), which is what ``from_pretrained`` runs for the
    tensors a checkpoint lacks (the rotary ``inv_freq`` buffers included); else its own ``reset_parameters()``. A
    peft LoRA adapter is made as peft makes it (``lora_B`` zero, so the adapted model starts as its base)."""
    if (method := root_method(root, "param_init_fn")) is not None:
        return method
    if (adapter := peft_private.lora_adapter(root, name)) is not None:
        which, how, rank = adapter
        return peft_private.lora_init(which, how=how, rank=rank)
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        if (method := root_method(root.get_submodule(".".join(parts[:depth])), "_init_weights")) is not None:
            return method
    if not callable(getattr(root.get_submodule(name), "reset_parameters", None)):
        return None
    return _reset_parameters


def _reset_parameters(copy: nn.Module) -> None:
    """A module's own initialization, on the copy ``materialize`` makes of it."""
    copy.reset_parameters()  # type: ignore[operator]  # torch types a module's other attributes as tensors


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def check_initializable(model: nn.Module, needed: set[str] | None = None) -> str | None:
    """Why a meta-device model could not be materialized on the ranks (``initializing.materialize``), or None.
    ``needed``: the fully qualified names of the tensors the ranks must make (those a checkpoint lacks);
    None, every tensor."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = [*torch_private.own_parameters(module), *torch_private.own_buffers(module)]
        wanted = [key for key in own if needed is None or prefix + key in needed]
        if _owns_tensors(module) and wanted and init_function(model, name) is None:
            if (adapter := peft_private.lora_adapter(model, name)) is not None:
                return (
                    f"{name} is a LoRA adapter with init_lora_weights={adapter[1]!r}, which the ranks cannot apply "
                    "to one adapter matrix on its own (it reads the base layer's weights, or makes both matrices "
                    "at once): use init_lora_weights=True (or 'gaussian'), or wrap a base with real weights"
                )
            if needed is not None:
                names = ", ".join(prefix + key for key in wanted)
                return (
                    f"{names} ({type(module).__name__}) is in no checkpoint and has no reset_parameters(): give "
                    "the model a param_init_fn(module) method, or a checkpoint that holds it"
                )
            return (
                f"{name or 'the root'} ({type(module).__name__}) has no reset_parameters(): give the model a "
                "param_init_fn(module) method, or build it with real weights"
            )
    return None


#: FSDP2's default that lets it choose for the root (None since torch 2.8; before, it always chose).
ROOT_RESHARD_LEFT_TO_FSDP = inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
