"""FSDP settings in Composer's ``fsdp_config`` vocabulary, validated, and what each means in FSDP2.

People learn FSDP from Composer's docs, so the names and defaults are
Composer's; ``sharding.py`` maps them onto FSDP2. Where FSDP2 has no exact
equivalent the mapping says so (``effective_backward_prefetch`` and ``why``).
Runs in the notebook's kernel; the engines get a config every default of which
``validate`` has filled in for the device.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from nbfsdp.shared.devices import DEVICE_CHOICES, DeviceChoice, Devices, low_precision_for
from nbfsdp.shared.errors import ConfigError

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
MixedPrecision = Literal["FULL", "DEFAULT", "PURE", "STORED"]
Precision = Literal["bf16", "fp16"]
BackwardPrefetch = Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"]
CheckpointScope = Literal["block", "attention"]
#: The choices of each setting, read off its type: the flags, the controls and ``resolve`` check against these.
SHARDING_STRATEGIES: tuple[ShardingStrategy, ...] = get_args(ShardingStrategy)
MIXED_PRECISIONS: tuple[MixedPrecision, ...] = get_args(MixedPrecision)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
BACKWARD_PREFETCHES: tuple[BackwardPrefetch, ...] = get_args(BackwardPrefetch)
CHECKPOINT_SCOPES: tuple[CheckpointScope, ...] = get_args(CheckpointScope)
#: ``None``: "as stored", each parameter (or buffer) in the dtype the model holds it in (FSDP2's policy field None).
_DTYPES: dict[str, torch.dtype | None] = {
    "stored": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")
#: Each name as (param, reduce, buffer) dtypes, "low" being ``precision`` (bf16 unless fp16 is asked), "stored"
#: the dtype the model stores each tensor in (no cast: FSDP2's ``MixedPrecisionPolicy`` field left None).
#: DEFAULT is Composer's FSDP2 code's (``get_mixed_precision``, used by ``prepare_distributed``) and
#: torchtitan's default: compute in low precision, reduce gradients in fp32. Composer also asks for low
#: buffers, which FSDP2's ``MixedPrecisionPolicy`` has no field for; nbfsdp leaves buffers in fp32 under
#: DEFAULT, as FSDP2 and torchtitan do (a RoPE table or BatchNorm statistics in bf16 lose precision that
#: the compute does not need to lose), and casts them only under PURE or where a dict asks.
#: FULL is one process's math: an fp32 model computes in fp32, and a parameter or buffer the model stores in bf16
#: (a frozen base, a block written for bf16) is never cast up: it computes as stored, as it would in one
#: process; gradients are reduced in fp32 and stored in their parameter's dtype. STORED is FSDP2's own default,
#: ``fully_shard`` without a policy: no cast anywhere, gradients reduced in their parameters' dtype.
MIXED_PRECISION = {
    "FULL": ("stored", "fp32", "stored"),
    "DEFAULT": ("low", "fp32", "fp32"),
    "PURE": ("low", "low", "low"),
    "STORED": ("stored", "stored", "stored"),
}
#: Composer 0.11's documented DEFAULT (fp32 compute, low-precision reduction), as a ``--config`` dict.
COMPOSER_0_11_DEFAULT = {"param_dtype": "fp32", "reduce_dtype": "bf16", "buffer_dtype": "fp32"}
#: Settings a running cell can switch at a step boundary; the others need another mesh or placement.
LIVE_SETTINGS = (
    "sharding_strategy", "mixed_precision", "precision", "backward_prefetch", "forward_prefetch",
    "activation_checkpointing",
)  # fmt: skip
#: Strategies a running cell can switch between: the same mesh, only resharding after forward differs.
LIVE_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")

#: Composer keys that FSDP2 makes moot; accepted so a Composer dict works unchanged.
COMPOSER_KEYS_WITHOUT_EFFECT = {
    "limit_all_gathers": "FSDP2 always limits in-flight all-gathers",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "verbose": "nbfsdp shows the plan with %fsdp explain",
    "state_dict_type": "the notebook always gets the full state dict back",
    "auto_wrap": "wrapping follows _fsdp_wrap, fsdp_wrap_fn, min_params and wrap_cls",
    "activation_checkpointing_reentrant": "FSDP2 uses non-reentrant checkpointing",
    "keep_low_precision_grads": "FSDP2 keeps gradients in the parameters' dtype",
    "load_monolith_rank0_only": "the notebook is the only source of weights",
    "data_parallel_shard_degree": "the shard degree is world size / data_parallel_replicate_degree",
}


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """The settings of one ``%%fsdp`` cell, with Composer's names and defaults."""

    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    """FULL_SHARD (ZeRO-3, default), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (replicated, like DDP) or HYBRID_SHARD
    (sharded inside replica groups, replicated across them)."""
    mixed_precision: MixedPrecision | dict | None = None
    """FULL: one process's math, fp32 for an fp32 model, a tensor stored in bf16 computing as stored, fp32
    gradient reduction (default on CPU); DEFAULT: low-precision parameters (the compute), fp32 gradient
    reduction, fp32 buffers (default on GPU; Composer's FSDP2 meaning, torchtitan's default; FSDP2's policy
    has no buffer dtype); PURE: low precision throughout; STORED: every tensor as the model stores it, gradients
    reduced in their own dtype (FSDP2's defaults). In a --config dict also a dict of param_dtype /
    reduce_dtype / buffer_dtype (each fp32, bf16, fp16 or stored)."""
    precision: Precision | None = None
    """The low precision of DEFAULT and PURE (default bf16; fp16 on GPUs below compute capability 8.0, which have
    no bf16); fp16 losses are scaled by nbfsdp (GradScaler). Given, DEFAULT is the default on CPU too."""
    backward_prefetch: BackwardPrefetch | None = None
    """Gather the next unit during backward (default: Composer's BACKWARD_POST, which FSDP2 has not: it
    runs as BACKWARD_PRE)."""
    forward_prefetch: bool = False
    """Gather the next unit during forward."""
    activation_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them (Composer's module rules decide where)."""
    checkpoint_every: int = 1
    """With activation checkpointing: checkpoint one chosen block in every N (the 1st, the N+1th...;
    torchtitan's selective_ac_option N): N times fewer recomputes, the other blocks' activations kept."""
    checkpoint_scope: CheckpointScope = "block"
    """With activation checkpointing: recompute each chosen block whole (block), or only its attention (the
    submodule whose class name has Attention or Attn): attention's activations, which grow with the sequence,
    for attention's FLOPs alone."""
    activation_cpu_offload: bool = False
    """Keep saved activations on the CPU until backward needs them."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU."""
    min_params: int = int(1e8)
    """Wrap a module as its own unit once it holds this many not-yet-wrapped parameters (default 1e8)."""
    wrap_cls: tuple[str, ...] = ()
    """Class names whose instances are FSDP units (TorchAcc's wrap classes), comma-separated."""
    replicas: int | None = None
    """HYBRID_SHARD: this many replica groups, each sharding the model (Composer's
    data_parallel_replicate_degree)."""
    reshard_after_forward: int | None = None
    """FULL_SHARD and HYBRID_SHARD: after its forward each unit keeps its parameters sharded over groups of this
    many ranks, not all of them (FSDP2's reshard_after_forward=N: a divisor of the ranks a unit is sharded over,
    other than 1 and all), so backward gathers them inside the group (on one host: a GPU count) and a rank
    holds 1/N of a unit between its forward and its backward. Default: as the strategy says."""
    sync_module_states: bool = False
    """A model built on the meta device: rank 0 initializes it whole and broadcasts the shards (without it
    every rank initializes its own shards under the same seeds)."""
    device: DeviceChoice | None = None
    """cuda: every rank on a GPU, rank r on GPU r mod G (several ranks share one where there are fewer GPUs;
    NCCL between them goes over sockets); cpu: gloo; auto (default, or $NBFSDP_DEVICE): a GPU a rank where
    there are enough, else the CPU. A validated config holds the device chosen, cuda or cpu."""
    memory_limit: int | None = None
    """Each rank's memory, as a size (48MB, 512MiB, 2GiB): past it a rank runs out of memory as a GPU does (CPU
    ranks: nbfsdp's accounting by FSDPMemTracker raises CUDA's error; GPU ranks: the allocator's fraction of
    the GPU), and the cell reports each rank's bytes beside the planner's and the flags that fit. Default: none
    on CPU; on GPU 1/k of the GPU where k ranks share one; ``none`` for none."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Composer keys given that have no effect under FSDP2, with why."""
    why: dict[str, str] = field(default_factory=dict)
    """Settings nbfsdp chose (a default for the device) or runs otherwise than asked, with why."""

    def dtypes(self) -> tuple[torch.dtype | None, ...]:
        """(param, reduce, buffer) dtypes of the mixed-precision setting; None: as the model stores each tensor."""
        if self.mixed_precision is None or self.precision is None:
            raise ValueError("settings not given: validate(config, world_size, devices) fills them in")
        if isinstance(self.mixed_precision, dict):
            return tuple(_DTYPES[self.mixed_precision.get(k, "fp32")] for k in _MIXED_PRECISION_KEYS)
        low = _DTYPES[self.precision]
        return tuple(low if dtype == "low" else _DTYPES[dtype] for dtype in MIXED_PRECISION[self.mixed_precision])

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) degrees of the device mesh."""
        match self.sharding_strategy:
            case "NO_SHARD":
                return world_size, 1
            case "HYBRID_SHARD":
                assert self.replicas is not None  # validate() requires it with HYBRID_SHARD
                return self.replicas, world_size // self.replicas
            case _:
                return 1, world_size

    @property
    def unit_reshard_after_forward(self) -> bool | int:
        """What ``fully_shard`` is given for every unit but the root: reshard to a group of N ranks, to all of
        them, or keep the unit gathered (SHARD_GRAD_OP)."""
        return self.reshard_after_forward or self.sharding_strategy != "SHARD_GRAD_OP"

    @property
    def effective_backward_prefetch(self) -> str | None:
        return "BACKWARD_PRE" if self.backward_prefetch == "BACKWARD_POST" else self.backward_prefetch

    def as_dict(self) -> dict[str, Any]:
        """The effective settings, with Composer's key names and values."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        settings["backward_prefetch"] = self.effective_backward_prefetch
        settings["wrap_cls"] = list(self.wrap_cls)
        settings["ignored"] = dict(self.ignored)
        settings["why"] = dict(self.why)
        return settings


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices``, spelled as they are (matched in any case)."""
    spelled = {choice.lower(): choice for choice in choices}
    if not isinstance(value, str) or value.lower() not in spelled:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
    return spelled[value.lower()]


def _mixed_precision(value: Any) -> str | dict:
    if isinstance(value, dict):
        unknown = set(value) - set(_MIXED_PRECISION_KEYS)
        if unknown:
            raise ConfigError(
                f"mixed_precision dict keys are {', '.join(_MIXED_PRECISION_KEYS)}; got {sorted(unknown)}"
            )
        for key, dtype in value.items():
            if str(dtype).removeprefix("torch.").replace("None", "stored") not in _DTYPES:
                raise ConfigError(f"mixed_precision {key} must be one of {', '.join(_DTYPES)}; got {dtype!r}")
        return {key: str(dtype).removeprefix("torch.").replace("None", "stored") for key, dtype in value.items()}
    return _choice("mixed_precision", value, MIXED_PRECISIONS)


def _positive_int(key: str, value: Any) -> int:
    try:
        number = int(float(value))
    except (TypeError, ValueError):
        number = -1
    if number < 0 or isinstance(value, bool):
        raise ConfigError(f"{key} must be a non-negative whole number; got {value!r}")
    return number


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "device": lambda v: _choice("device", v, DEVICE_CHOICES),
    "sharding_strategy": lambda v: _choice("sharding_strategy", v, SHARDING_STRATEGIES),
    "mixed_precision": _mixed_precision,
    "precision": lambda v: _choice("precision", str(v), PRECISIONS),
    "backward_prefetch": lambda v: _choice("backward_prefetch", "NONE" if v is None else v, BACKWARD_PREFETCHES),
    "forward_prefetch": bool,
    "activation_checkpointing": bool,
    "checkpoint_every": lambda v: _positive_int("checkpoint_every", v),
    "checkpoint_scope": lambda v: _choice("checkpoint_scope", v, CHECKPOINT_SCOPES),
    "activation_cpu_offload": bool,
    "cpu_offload": bool,
    "min_params": lambda v: _positive_int("min_params", v),
    "wrap_cls": lambda v: tuple(c.strip() for c in (v.split(",") if isinstance(v, str) else v) if c.strip()),
    "replicas": lambda v: None if v is None else _positive_int("replicas", v),
    "reshard_after_forward": lambda v: None if v is None else _positive_int("reshard_after_forward", v),
    "data_parallel_replicate_degree": lambda v: None if v is None else _positive_int("replicas", v),
    "sync_module_states": bool,
    "memory_limit": lambda v: (
        None if v is None or str(v).strip().lower() in ("", "none") else size_bytes(v, "memory_limit")
    ),
}
_ALIASES = {"data_parallel_replicate_degree": "replicas"}


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def size_bytes(value: str | int | float, what: str = "size", examples: str = "48MB, 512MiB or 2GiB") -> int:
    """``48MB``, ``512MiB``, ``2 GiB`` or a number of bytes, as bytes; anything else a ``ConfigError`` naming
    ``examples``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
    if not found or found[2] not in _SIZE_UNITS or float(found[1]) <= 0:
        raise ConfigError(f"{what} must be a size such as {examples}; got {value!r}")
    return int(float(found[1]) * _SIZE_UNITS[found[2]])


def resolve(
    composer_dict: dict[str, Any] | None, flags: dict[str, Any], panel: dict[str, Any] | None = None
) -> FSDPConfig:
    """Defaults < the panel's settings < a Composer ``fsdp_config`` dict < explicit flags; every value checked."""
    settings: dict[str, Any] = {}
    ignored: dict[str, str] = {}
    for source in (panel or {}, composer_dict or {}, {k: v for k, v in flags.items() if v is not None}):
        for key, value in source.items():
            if key in CHECKPOINT_KEYS:
                continue  # a run setting of the same dict: ``checkpoint_settings`` reads it
            if key in COMPOSER_KEYS_WITHOUT_EFFECT:
                ignored[key] = COMPOSER_KEYS_WITHOUT_EFFECT[key]
            elif key in _CONVERTERS:
                settings[_ALIASES.get(key, key)] = _CONVERTERS[key](value)
            else:
                valid = sorted([*_CONVERTERS, *COMPOSER_KEYS_WITHOUT_EFFECT, *CHECKPOINT_KEYS])
                raise ConfigError(f"unknown fsdp_config key {key!r}; valid keys: {', '.join(valid)}")
    return FSDPConfig(**settings, ignored=ignored)


#: Why a setting not given takes the value it does.
_FULL_ON_CPU = (
    "not given; one process's math on CPU: fp32 for an fp32 model, a tensor stored in bf16 as stored "
    "(DEFAULT or PURE to compute in bf16)"
)
_DEFAULT_PREFETCH = (
    "not given; Composer's default BACKWARD_POST, which FSDP2 does not have, runs as FSDP2's own backward prefetch"
)
_POST_ASKED = "BACKWARD_POST asked, which FSDP2 does not have (it can prefetch the wrong unit, pytorch#108190)"


def _fp16_where_no_bf16(capability: tuple[int, int] | None) -> str:
    major, minor = capability or (0, 0)
    return (
        f"not given; GPUs of compute capability {major}.{minor} have no bf16 (it needs 8.0): fp16, the losses "
        "scaled by nbfsdp (GradScaler's dynamic scale, no code in the cell); --precision bf16 to override"
    )


def for_device(config: FSDPConfig, devices: Devices) -> FSDPConfig:
    """``config`` with the settings not given filled in as Composer would on ``devices``, saying why; its
    ``device`` is the one chosen."""
    why = dict(config.why)
    mixed_precision, backward_prefetch = config.mixed_precision, config.backward_prefetch
    capability = devices.capability if devices.type == "cuda" else None
    precision = config.precision or low_precision_for(capability)
    if devices.why:
        why["device"] = devices.why
    if mixed_precision is None and devices.type == "cpu" and config.precision is None:
        mixed_precision, why["mixed_precision"] = "FULL", _FULL_ON_CPU
    elif mixed_precision is None:  # Composer's DEFAULT wherever its precision is low: on GPU, or asked for
        where = "on GPU" if devices.type == "cuda" else "once a precision is given"
        mixed_precision = "DEFAULT"
        why["mixed_precision"] = (
            f"not given; Composer's default {where}: {precision} parameters (the compute), gradients reduced in fp32"
        )
    if config.precision is None and precision == "fp16" and mixed_precision in ("DEFAULT", "PURE"):
        why["precision"] = _fp16_where_no_bf16(capability)
    if backward_prefetch is None:
        backward_prefetch, why["backward_prefetch"] = "BACKWARD_PRE", _DEFAULT_PREFETCH
    elif backward_prefetch == "BACKWARD_POST":
        why["backward_prefetch"] = f"{_POST_ASKED}: FSDP2's own backward prefetch runs"
    chosen: dict[str, Any] = {
        "device": devices.type,
        "mixed_precision": mixed_precision,
        "precision": precision,
        "backward_prefetch": backward_prefetch,
    }
    return dataclasses.replace(config, **chosen, why=why)


def validate(config: FSDPConfig, world_size: int, devices: Devices, *, quiet: bool = False) -> FSDPConfig:
    """Checks that need the world (mesh shape, what the device can run); the config the ranks run.

    An explicit BACKWARD_POST is said in one line on stderr unless ``quiet`` (a plan shows it anyway).
    """
    config = for_device(config, devices)
    if config.sharding_strategy == "HYBRID_SHARD":
        replicas = config.replicas
        if not replicas or world_size % replicas or not 1 <= replicas <= world_size:
            raise ConfigError(f"HYBRID_SHARD needs --replicas R dividing the world size {world_size}; got {replicas}")
    if config.reshard_after_forward is not None:
        _check_reshard_after_forward(config, world_size)
    if config.backward_prefetch == "BACKWARD_POST" and not quiet:
        print(f"nbfsdp: {_POST_ASKED}: running FSDP2's own (BACKWARD_PRE)", file=sys.stderr)
    return config


def _check_reshard_after_forward(config: FSDPConfig, world_size: int) -> None:
    group, shards = config.reshard_after_forward, config.mesh_shape(world_size)[1]
    if config.sharding_strategy not in ("FULL_SHARD", "HYBRID_SHARD"):
        raise ConfigError(
            f"reshard_after_forward N needs FULL_SHARD or HYBRID_SHARD (with {config.sharding_strategy} "
            f"{'a unit stays gathered' if config.sharding_strategy == 'SHARD_GRAD_OP' else 'nothing is sharded'}"
            f" after forward); got {group}"
        )
    divisors = [n for n in range(2, shards) if shards % n == 0]
    if group not in divisors:
        some = f"one of {', '.join(map(str, divisors))}" if divisors else f"none at {shards} (4 ranks or more)"
        raise ConfigError(
            f"reshard_after_forward must divide the {shards} ranks a unit is sharded over, other than 1 and "
            f"{shards}: {some}; got {group}"
        )


#: Composer's checkpoint keys, accepted as %%fsdp flags (``--save-folder``) and in a ``--config`` dict.
CHECKPOINT_KEYS = (
    "save_folder", "save_interval", "save_num_checkpoints_to_keep", "autoresume", "load_path", "load_ignore_keys",
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class CheckpointSettings:
    """A cell's checkpoint settings, in Composer's names.

    Kept out of ``FSDPConfig`` on purpose: they say what the run saves and loads, not how a model is
    sharded, so they do not belong in a model's fingerprint (another folder must not re-send the model)
    nor in a checkpoint's manifest or the live controls.
    """

    save_folder: str | None = None
    """Where --save-interval saves (DIR/step-N) and --autoresume looks."""
    save_interval: int | None = None
    """Save a checkpoint at nbfsdp.log(step=s) when (s + 1) % N == 0, on every rank (needs --save-folder)."""
    save_num_checkpoints_to_keep: int = -1
    """Keep the K newest complete checkpoints in the save folder (default -1: all, Composer's default)."""
    autoresume: bool = False
    """Before the cell, load the newest complete checkpoint in --save-folder, if any; resume_step is its step."""
    load_path: str | None = None
    """Before the cell, load this checkpoint; resume_step is its step (--autoresume, when it finds one, wins,
    as in Composer)."""
    load_ignore_keys: list[str] = field(default_factory=list)
    """With --load-path or --autoresume: globs on the checkpoint's keys to skip, e.g. 'optimizers.*'."""

    @property
    def loads(self) -> bool:
        return self.autoresume or self.load_path is not None


def _save_interval(value: Any) -> int:
    """A positive whole number of steps; Composer's ``"50ba"`` (batches) too."""
    text = str(value).strip().lower().removesuffix("ba") if isinstance(value, (str, int)) else ""
    if isinstance(value, bool) or not text.isdigit() or int(text) <= 0:
        raise ConfigError(
            f"save_interval must be a positive whole number of steps (e.g. 50, or Composer's '50ba'); got {value!r}"
        )
    return int(text)


def _keep(value: Any) -> int:
    try:
        number = int(value) if not isinstance(value, bool) and float(value) == int(float(value)) else 0
    except (TypeError, ValueError):
        number = 0
    if number == 0 or number < -1:
        raise ConfigError(f"save_num_checkpoints_to_keep must be -1 (keep all) or a positive count; got {value!r}")
    return number


def _keys(value: Any) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"load_ignore_keys must be globs, as a list or comma-separated; got {value!r}")
    return [item.strip() for item in items if item.strip()]


def _text(key: str) -> Any:
    def convert(value: Any) -> str:
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            raise ConfigError(f"{key} must be a path; got {value!r}")
        return str(value)

    return convert


_CHECKPOINT_CONVERTERS = {
    "save_folder": _text("save_folder"),
    "save_interval": _save_interval,
    "save_num_checkpoints_to_keep": _keep,
    "autoresume": bool,
    "load_path": _text("load_path"),
    "load_ignore_keys": _keys,
}


def checkpoint_settings(composer_dict: dict[str, Any] | None, flags: dict[str, Any]) -> CheckpointSettings:
    """The ``CHECKPOINT_KEYS`` of a ``--config`` dict < explicit flags (None: not given); checked together."""
    settings: dict[str, Any] = {}
    for source in (composer_dict or {}, flags):
        for key, value in source.items():
            if key in _CHECKPOINT_CONVERTERS and value is not None:
                settings[key] = _CHECKPOINT_CONVERTERS[key](value)
    result = CheckpointSettings(**settings)
    if result.save_interval is not None and result.save_folder is None:
        raise ConfigError("save_interval needs save_folder: where the checkpoints go (--save-folder DIR)")
    if result.save_folder is not None and result.save_interval is None and not result.autoresume:
        raise ConfigError("save_folder needs save_interval N (save every N steps) or autoresume (resume from it)")
    if result.autoresume and result.save_folder is None:
        raise ConfigError("autoresume needs save_folder: the folder whose newest checkpoint it loads")
    if result.save_num_checkpoints_to_keep != -1 and result.save_interval is None:
        raise ConfigError("save_num_checkpoints_to_keep needs save_interval: it prunes the interval saves")
    if result.load_ignore_keys and not result.loads:
        raise ConfigError("load_ignore_keys needs load_path or autoresume: nothing is loaded otherwise")
    return result
