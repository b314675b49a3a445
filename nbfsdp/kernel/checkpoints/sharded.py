"""``%fsdp save``, ``%fsdp load`` and ``%fsdp checkpoints``: the kernel's side of checkpoints.

    %fsdp save ckpt/manual            # what the engines hold now, each rank writing its own shards
    %fsdp load ckpt/manual -n 2       # into the running world, or a fresh one, resharded
    %fsdp checkpoints ckpt            # name, step, world size, complete or not, size, when

A save runs ``nbfsdp.engines.checkpointing.save`` on every rank at once. A load is checked here against
the notebook's own objects before any engine is touched (a missing object, another model's keys or
shapes: a ``UsageError``, nothing changed), then runs as an internal cell over those objects, so the
models reach a fresh world as any cell's do and the loaded weights, optimizer and scheduler state come
back into the notebook's objects in place when it ends, as a cell's do.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch.nn as nn
from IPython.core.error import UsageError
from torch.distributed.checkpoint import FileSystemReader
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from nbfsdp.engines import checkpointing, loading
from nbfsdp.kernel.checkpoints.pretrained import make_buffers
from nbfsdp.kernel.cluster.rank_calls import RankDied, RankError, RankFailed, gather, submit
from nbfsdp.kernel.cluster.world import RunningWorld
from nbfsdp.kernel.run import history, residence
from nbfsdp.kernel.run.session import Session, current_session
from nbfsdp.kernel.run.spec import ResumePoint, RunOptions
from nbfsdp.shared import checkpoints as fmt
from nbfsdp.shared.checkpoints import CheckpointError, CheckpointInfo, Manifest
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import CheckpointSettings, ConfigError, FSDPConfig
from nbfsdp.shared.config import resolve as resolve_settings
from nbfsdp.shared.limits import DEFAULT_TIMEOUT_SECONDS, world_size_error
from nbfsdp.shared.optimizers import recipe_class
from nbfsdp.shared.protocol import LoadCheckpoint, LoaderState, LoadWeightsFile, SaveTarget
from nbfsdp.shared.torch_private import dcp_load_in_one_process
from nbfsdp.shared.weights_files import SUFFIXES, full_weights_reader, hugging_face_checkpoint, match_names

#: How many differing keys an error names.
_NAMED = 5


def _session() -> Session:
    """The notebook's session, for the functions (``nbfsdp.save`` ...); the magics pass theirs."""
    return current_session()


def _usage(error: CheckpointError) -> UsageError:
    return UsageError(str(error))


# ------------------------------------------------------------------ save
def save(  # noqa: PLR0913 (public API: nbfsdp.save's keywords are %fsdp save's flags)
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    background: bool = False,
    hf: bool = False,
    max_shard_size: str | int | None = None,
    model: str | None = None,
    dtype: str | None = None,
) -> Manifest | PendingSave | Path:
    """Save what the engines hold now as a sharded checkpoint at ``path`` (``%fsdp save PATH``).

    Every sharded model of the running world, the optimizers and LR schedulers the cells left on the
    ranks, each rank's RNG states and split DataLoaders' positions; each rank writes only its own shards.
    The checkpoint appears under ``path`` only once complete. Returns its manifest.

    ``background=True`` (``--async``): returns once every rank has its snapshot, while the ranks write it
    and the next cells run; returns a ``PendingSave`` whose ``wait()`` gives the manifest (so do
    ``%fsdp wait``, ``%fsdp stop`` and the next save, which wait for it and raise its error).

    ``hf=True`` (``--hf``): the model ``model`` (default: the only one) as ``save_pretrained`` writes it,
    safetensors files of at most ``max_shard_size`` ("5GB" by default) with their index and the config, in
    ``dtype`` ("fp32", "bf16", "fp16"; default: what the ranks hold), never gathered in the kernel
    (``nbfsdp.kernel.checkpoints.hf_export``). Returns the directory.
    """
    hf_options = {"max_shard_size": max_shard_size, "model": model, "dtype": dtype}
    return save_with(_session(), path, overwrite=overwrite, background=background, hf=hf, **hf_options)


def _resume_step() -> int | None:
    """The step after the last ``nbfsdp.log(step=...)`` of the last run: where training resumes."""
    run = history.last_run()
    steps = [m["step"] for m in run.metrics if m.get("rank") == 0 and m.get("step") is not None] if run else []
    return max(steps) + 1 if steps else None


class PendingSave:
    """A ``%fsdp save --async`` the ranks are still writing; the session holds it until it is waited for."""

    def __init__(self, session: Session, world: RunningWorld, path: str | os.PathLike, partial: Path) -> None:
        self._session, self._world, self.path, self._partial = session, world, path, partial

    def wait(self) -> Manifest:
        """Wait for every rank's write and the checkpoint's completion; raise the write's error if it failed."""
        session = self._session
        session.forget_save(self)
        if session.cluster.world is not self._world:
            raise UsageError(
                f"the background save of {self.path} was lost: the world writing it stopped before it was "
                f"waited for; nothing complete was saved{_left(self._partial)}"
            )
        try:
            results = _on_every_rank(
                session, self._world, checkpointing.wait_background_save, (), "saving in the background", self._partial
            )
        except (UsageError, RankError):
            print(f"nbfsdp: the background save of {self.path} failed:", file=sys.stderr)
            raise
        text, skipped = results[0]
        manifest = Manifest.from_json(text)
        _report(self.path, manifest, skipped)
        return manifest


def _left(partial: Path) -> str:
    return f"; {partial.name} was left incomplete in {partial.parent} (safe to delete)" if partial.exists() else ""


def save_with(
    session: Session,
    path: str | os.PathLike,
    *,
    overwrite: bool,
    background: bool = False,
    hf: bool = False,
    **hf_options: Any,
) -> Manifest | PendingSave | Path:
    if not hf and any(value is not None for value in hf_options.values()):
        given = ", ".join(f"--{key.replace('_', '-')}" for key, value in hf_options.items() if value is not None)
        raise UsageError(f"{given}: only with --hf (a Hugging Face directory); an nbfsdp checkpoint takes every model")
    if hf and background:
        raise UsageError("--hf writes in the foreground: leave out --async")
    if session.active is not None:
        raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then save")
    session.wait_for_save()  # one save at a time: the one before must be complete (or its error said)
    world = session.cluster.world
    if world is None or world.broken:
        raise UsageError("nothing to save: no world is running (run a %%fsdp cell, or %fsdp load a checkpoint)")
    if not session.engine_models():
        raise UsageError("nothing to save: the engines hold no model (run a %%fsdp cell that reads one)")
    if hf:
        from nbfsdp.kernel.checkpoints import hf_export  # the --hf writer: imported only when used

        options = hf_export.HFOptions(**hf_options)
        return hf_export.save(session, path, options, overwrite=overwrite, on_every_rank=_on_every_rank)
    final = Path(path).expanduser().resolve()  # the engines may run in another directory
    try:
        fmt.check_target(final, overwrite=overwrite)
    except CheckpointError as error:
        raise _usage(error) from None
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = fmt.partial_path(final)
    namespace = session.shell.user_ns
    epochs = {name: session.loaders.epochs(value) for name, value in namespace.items() if isinstance(value, DataLoader)}
    target = SaveTarget(partial=str(partial), final=str(final), step=_resume_step(), overwrite=overwrite)
    args = (world.generation, target)
    if background:
        snapshot = functools.partial(checkpointing.save_in_background, epochs=epochs)
        skipped = _on_every_rank(session, world, snapshot, args, "taking a snapshot", partial)[0]
        _say_skipped(skipped)
        pending = PendingSave(session, world, path, partial)
        session.hold_save(pending)
        print(f"nbfsdp: saving {path} in the background (every rank has its snapshot); `%fsdp wait` for it")
        return pending
    save = functools.partial(checkpointing.save, epochs=epochs)
    text, skipped = _on_every_rank(session, world, save, args, "saving", partial)[0]
    manifest = Manifest.from_json(text)
    _report(path, manifest, skipped)
    return manifest


def _say_skipped(skipped: dict[str, str]) -> None:
    if skipped:
        print(f"nbfsdp: not saved: {'; '.join(f'{n} ({why})' for n, why in skipped.items())}", file=sys.stderr)


def _report(path: str | os.PathLike, manifest: Manifest, skipped: dict[str, str]) -> None:
    _say_skipped(skipped)
    written = ", ".join(size_text(b) for b in manifest.bytes_per_rank)
    step = f"step {manifest.step}" if manifest.step is not None else "no step logged"
    print(
        f"nbfsdp: saved {path} ({step}, {manifest.world_size} ranks wrote {written}): models "
        f"{', '.join(manifest.models)}; optimizers {', '.join(manifest.optimizers) or 'none'}; "
        f"schedulers {', '.join(manifest.schedulers) or 'none'}"
    )


def _on_every_rank(
    session: Session, world: RunningWorld, function: Any, args: tuple, doing: str, partial: Path
) -> list:
    """Run ``function(*args)`` on every rank at once; their results by rank.

    A rank that dies breaks the world (its peers wait in a collective): the error says so at once. A
    ``CheckpointError`` every rank raised together is the user's: a ``UsageError``, the world intact.
    """
    cluster = session.cluster
    engine_ids = dict(enumerate(world.engine_ids))
    try:
        results = submit(cluster.client, engine_ids, function, dict.fromkeys(engine_ids, args))
        return list(gather(results, cluster.dead_ranks).values())
    except RankDied as died:
        world.broken = True
        raise RankError(died.rank, f"engine died while {doing}: {died.how}{_left(partial)}") from None
    except RankFailed as failed:
        if failed.ename == "CheckpointError":
            raise UsageError(failed.evalue) from None
        if failed.ename != "CheckpointException":
            world.broken = True  # the ranks may disagree on where they are now: the next cell starts afresh
        # else DCP's own error (a full disk ...), which it hands every rank together: the world goes on
        raise RankError(failed.rank, f"{failed.ename}: {failed.evalue} (while {doing}){_left(partial)}") from None


# ------------------------------------------------------------------ load
def load(  # noqa: PLR0913 (public API: nbfsdp.load's parameters are %fsdp load's and load(into=...)'s)
    path: str | os.PathLike,
    world_size: int | None = None,
    load_ignore_keys: list[str] | str | None = None,
    *,
    model: str | None = None,
    into: nn.Module | None = None,
    optimizer: Optimizer | None = None,
    scheduler: Any = None,
) -> Manifest | list[int] | None:
    """Load a checkpoint into the running world, or a fresh one of ``world_size`` ranks (``%fsdp load``).

    The default world size is the running world's, or with none running the checkpoint's. The models,
    optimizers and schedulers of the checkpoint's names in the notebook take the loaded state in place;
    at the world size that saved it, each rank's RNG states and the loaders' positions carry over too.
    ``load_ignore_keys``: globs on the DCP keys to skip (``"optimizers.*"``; an optimizer skipped skips
    its scheduler). Returns the checkpoint's manifest.

    ``path`` a ``.pt`` or ``.safetensors`` file of full weights: each rank reads only its rows of it into
    the notebook's model ``model`` (default: the only one whose keys and shapes match), which then takes
    them in place; returns the bytes each rank read.

    ``into=`` a plain model (with ``optimizer=`` and ``scheduler=``): the checkpoint goes straight into
    these objects, in place, in the kernel; no engine is touched or started (``model=``: which of the
    checkpoint's models, when it holds several). Returns None.
    """
    if into is not None:
        if world_size is not None or load_ignore_keys:
            raise UsageError("load(into=...) reads in the kernel: world_size and load_ignore_keys do not apply")
        from nbfsdp.kernel.checkpoints import exporting  # the kernel's reader: imported only when used

        exporting.load_into(path, into, optimizer, scheduler, model=model)
        print(f"nbfsdp: loaded {path} into {type(into).__name__} in the notebook (no engines)")
        return None
    if optimizer is not None or scheduler is not None:
        raise UsageError("optimizer= and scheduler= go with into= (a plain model); a world loads them by name")
    return load_with(_session(), path, world_size, load_ignore_keys, model=model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NextCell:
    """The settings of the cell a load runs just before (``--load-path``, ``--autoresume``), together: the load
    starts the world and shards the models under them, so that cell finds both as the load left them."""

    config: FSDPConfig
    timeout: float


def load_with(
    session: Session,
    path: str | os.PathLike,
    world_size: int | None,
    ignore: list[str] | str | None,
    *,
    cell: NextCell | None = None,
    model: str | None = None,
) -> Manifest | list[int]:
    """``cell``: the cell the load runs before, whose settings it takes; by default the checkpoint's settings
    and the running world's timeout. A full-weights file instead of a checkpoint: ``load_file_with``, into the
    notebook's model ``model``."""
    if session.active is not None:
        raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then load")
    session.wait_for_save()  # a load may read what it writes, or start another world
    full_weights = hugging_face_checkpoint(os.fspath(path)) is not None
    if full_weights or (Path(path).suffix in SUFFIXES and not Path(path).expanduser().is_dir()):
        if ignore:
            raise UsageError("--load-ignore-keys applies to checkpoints; full weights load whole into one model")
        return load_file_with(session, path, world_size, model, cell=cell)
    if model is not None:
        raise UsageError(
            "--model names the notebook's model for a .pt or .safetensors file or a Hugging Face checkpoint "
            "directory; an nbfsdp checkpoint loads by name"
        )
    patterns = [p.strip() for p in ignore.split(",")] if isinstance(ignore, str) else list(ignore or [])
    patterns = [p for p in patterns if p]
    directory = Path(path).expanduser().resolve()
    try:
        manifest = fmt.read_manifest(directory)
    except CheckpointError as error:
        raise _usage(error) from None
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    namespace = session.shell.user_ns
    models = _notebook_models(manifest, namespace, saved, patterns)
    kept_optimizers = {
        name: owner for name, owner in manifest.optimizers.items() if not fmt.ignored(f"optimizers.{name}", patterns)
    }
    rebuilt = _made_on_the_ranks(manifest, kept_optimizers, namespace)
    optimizers = _notebook_optimizers(kept_optimizers, models, namespace, rebuilt)
    schedulers = _notebook_schedulers(manifest, optimizers, namespace, patterns, rebuilt)
    running = session.cluster.world
    if world_size is None:
        world_size = running.world_size if running and not running.broken else manifest.world_size
    if refused := world_size_error(world_size):
        raise UsageError(refused)
    same = world_size == manifest.world_size
    if not same:
        print(
            f"nbfsdp: saved at world size {manifest.world_size}, loading at {world_size}: RNG states and data "
            "positions do not carry over (models, optimizers and schedulers do)"
        )
    if cell is not None:
        config, timeout = cell.config, cell.timeout
    else:  # the saved settings, on the device the running world has (any, with none running), and its timeout
        first = next(iter(manifest.models.values()))
        fsdp = {**first["fsdp"], "wrap_cls": tuple(first["fsdp"]["wrap_cls"]), "device": None}
        config = _on_running_device(FSDPConfig(**fsdp), running)
        timeout = running.timeout if running and not running.broken else DEFAULT_TIMEOUT_SECONDS
    request = LoadCheckpoint(
        directory=str(directory),
        models=list(models),
        optimizers=dict(optimizers),
        schedulers=list(schedulers),
        ignore=patterns,
        restore_rng=same,
        rebuilt={name: {"recipe": manifest.recipes[name], "owner": optimizers[name]} for name in rebuilt},
    )
    if patterns or any(p.is_meta for model in models.values() for p in model.parameters()):
        # part of a checkpoint, or a model with no storage yet: the notebook takes what the ranks loaded
        session.run_cell(request, config, RunOptions(world_size=world_size, timeout=timeout, gather=True))
    else:
        # the kernel reads the same files into the notebook's objects while the ranks load theirs: nothing
        # loaded is gathered back, and the next cell sends none of them (the notebook holds what the ranks do)
        from nbfsdp.kernel.checkpoints import exporting  # the kernel's reader: imported only when used

        objects = {name: (namespace[name], owner) for name, owner in optimizers.items() if name not in rebuilt}
        reading = exporting.NotebookRead(directory, models, objects, {n: namespace[n] for n in schedulers})
        session.run_cell(request, config, RunOptions(world_size=world_size, timeout=timeout, gather=False))
        reading.apply()
        in_sync = [name for name in [*optimizers, *schedulers] if name not in rebuilt]
        session.held.now_in_sync(models, {name: namespace[name] for name in in_sync})
    loaders = [n for n in manifest.loaders if same and not fmt.ignored(f"loaders.rank0.{n}", patterns)]
    part_way: dict[str, LoaderState] = {}
    for name, state in _loader_positions(directory, loaders).items():
        if isinstance(namespace.get(name), DataLoader):
            session.loaders.restore(namespace[name], state)
            if getattr(state, "taken", 0):  # saved part-way through an epoch: the next cell goes on there
                part_way[name] = state
    step = f"step {manifest.step}" if manifest.step is not None else "no step"
    print(
        f"nbfsdp: loaded {path} ({step}) into {world_size} ranks: models {', '.join(models)}; "
        f"optimizers {', '.join(optimizers) or 'none'}; schedulers {', '.join(schedulers) or 'none'}"
    )
    session.resume_after_load(ResumePoint(step=manifest.step or 0, loaders=part_way))
    return manifest


def _on_running_device(config: FSDPConfig, running: RunningWorld | None) -> FSDPConfig:
    """``config``, on the running world's device where it names none: a load goes into the world there is."""
    if config.device is not None or running is None or running.broken:
        return config
    return dataclasses.replace(config, device="cuda" if running.devices.type == "cuda" else "cpu")


def load_file_with(
    session: Session,
    path: str | os.PathLike,
    world_size: int | None,
    model: str | None,
    *,
    cell: NextCell | None = None,
) -> list[int]:
    """A ``.pt`` or ``.safetensors`` file of full weights, or a Hugging Face checkpoint directory (or its
    index file), into the notebook's model ``model``, sharded.

    The names and shapes are checked here against the model first (the files' headers only: nothing is
    read), matched as ``from_pretrained`` matches them (``weights_files.match_names``). Then an internal
    cell over the model has each rank read only its rows of each tensor (``full_weights_reader``), not the
    kernel sending whole weights; its end brings them back into the notebook's model in place. Returns the
    bytes of tensor data each rank read.
    """
    file = Path(path).expanduser().resolve()  # the engines may run in another directory
    try:
        with full_weights_reader(file) as reader:
            names = reader.keys()  # a WeightsFile is not iterable itself
            shapes = {key: reader.shape(key) for key in names}
    except ConfigError as error:
        raise UsageError(str(error)) from None
    namespace = session.shell.user_ns
    name = _weights_model(path, shapes, namespace, model)
    running = session.cluster.world
    alive = running if running is not None and not running.broken else None  # a world to load into as it is
    if world_size is None:
        world_size = alive.world_size if alive else (session.panel_world_size or session.cluster.default_world_size())
    if refused := world_size_error(world_size):
        raise UsageError(refused)
    target = namespace[name]
    on_meta = any(p.is_meta for p in target.parameters())
    if on_meta:  # its weights are read by the ranks as they shard it, and then live there (residence)
        make_buffers(target)
        residence.check_reads(target, shapes, path)
        residence.mark(target, source=str(file))
        session.held.forget_model(name)
    request = LoadWeightsFile(path=str(file), model=name, read_when_sharded=on_meta)
    if cell is not None:
        config, timeout = cell.config, cell.timeout
    else:  # the settings the next cell takes by default (the panel's, else the defaults), the running world's timeout
        try:
            config = _on_running_device(resolve_settings(None, {}, session.panel), alive)
        except ConfigError as error:
            raise UsageError(str(error)) from None
        timeout = alive.timeout if alive else DEFAULT_TIMEOUT_SECONDS
    session.run_cell(request, config, RunOptions(world_size=world_size, timeout=timeout, gather=True))
    world = session.cluster.world
    assert world is not None  # the cell just ran in it
    client = session.cluster.client
    read = [client[engine_id].apply_sync(loading.bytes_read) for engine_id in world.engine_ids]
    tensors = {id(t): t for t in namespace[name].state_dict(keep_vars=True).values()}  # a tie counts once
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"nbfsdp: loaded {path} into {name} on {world_size} ranks, each reading its shard: "
        f"{', '.join(size_text(b) for b in read)} of {size_text(total)}"
    )
    return read


def _weights_model(
    path: str | os.PathLike, shapes: dict[str, tuple], namespace: dict[str, Any], name: str | None
) -> str:
    """The notebook's model the file's weights fit: ``name``'s, checked, or the only one that fits."""
    if name is not None:
        if not isinstance(namespace.get(name), nn.Module):
            raise UsageError(f"--model {name}: no nn.Module of that name in the notebook")
        problems = _weights_problems(shapes, namespace[name])
        if problems:
            raise UsageError(f"{path} does not fit {name}: {problems}")
        return name
    modules: dict[int, str] = {}
    for key, value in namespace.items():
        if isinstance(value, nn.Module) and not key.startswith("_") and id(value) not in modules:
            modules[id(value)] = key
    fits = {key: _weights_problems(shapes, namespace[key]) for key in modules.values()}
    matching = [key for key, problems in fits.items() if not problems]
    if len(matching) == 1:
        return matching[0]
    if matching:
        raise UsageError(f"{path} fits several models in the notebook ({', '.join(matching)}): pass --model NAME")
    if not fits:
        raise UsageError(f"{path}: no nn.Module in the notebook to load it into: build the model first")
    why = "; ".join(f"{key}: {problems}" for key, problems in list(fits.items())[:3])
    raise UsageError(f"{path} fits no model in the notebook (candidates {', '.join(fits)}): {why}")


def _weights_problems(shapes: dict[str, tuple], module: nn.Module) -> str:
    """What keeps weights of these names and shapes from loading into ``module`` ("" when nothing does).

    A tie is one tensor under several names: the weights need one of them (Hugging Face keeps one). A model on
    the meta device may lack some, as ``from_pretrained``'s may: the ranks make them (``residence.check_reads``)."""
    match = match_names(module, shapes)
    if any(p.is_meta for p in module.parameters()):
        match.missing = []
    return match.problems(_NAMED)


def load_before_cell(
    session: Session, settings: CheckpointSettings, world_size: int, timeout: float, config: FSDPConfig
) -> None:
    """``--autoresume`` and ``--load-path``, before a ``%%fsdp`` cell: load what they name into its world.

    Autoresume takes the newest complete checkpoint in the save folder (by step) and wins over
    ``load_path``, as in Composer; with none there it says so in one line and the cell starts at step 0
    (or from ``load_path``). The load is ``%fsdp load``'s, at the cell's world size and settings.
    """
    path: str | os.PathLike | None = None
    if settings.autoresume:
        assert settings.save_folder is not None  # checkpoint_settings requires it with autoresume
        folder = Path(settings.save_folder).expanduser().resolve()
        try:
            found = fmt.newest(folder)
        except CheckpointError as error:
            raise _usage(error) from None
        if found is not None:
            path = found.path
            print(f"nbfsdp: autoresume: the newest complete checkpoint in {settings.save_folder} is {found.name}")
        else:
            then = f"loading {settings.load_path}" if settings.load_path else "starting at step 0"
            print(f"nbfsdp: autoresume: no complete checkpoint in {settings.save_folder}: {then}")
    path = path if path is not None else settings.load_path
    if path is None:
        return  # resume_step stays what it was: 0, or the step of a %fsdp load since the last cell
    load_with(session, path, world_size, settings.load_ignore_keys, cell=NextCell(config=config, timeout=timeout))


def _notebook_models(
    manifest: Manifest, namespace: dict[str, Any], saved: dict[str, Any], patterns: list[str]
) -> dict[str, nn.Module]:
    """The notebook's models of the checkpoint's names, each checked key by key and shape by shape; a model whose
    every key ``patterns`` skip needs none."""
    wanted = [
        name
        for name in manifest.models
        if not all(fmt.ignored(key, patterns) for key in saved if key.startswith(f"models.{name}."))
    ]
    missing = [name for name in wanted if not isinstance(namespace.get(name), nn.Module)]
    if missing:
        raise UsageError(
            f"the checkpoint's models {', '.join(missing)} are not nn.Modules in the notebook: build them "
            f"(e.g. {manifest.models[missing[0]]['class']}) under those names first, then load"
        )
    models = {name: namespace[name] for name in wanted}
    for name, model in models.items():
        prefix = f"models.{name}."
        expected = {
            f"{prefix}{fqn}": tuple(t.shape)
            for fqn, t in model.state_dict().items()
            if not fmt.ignored(f"{prefix}{fqn}", patterns)
        }
        there = {key: tuple(md.size) for key, md in saved.items() if key.startswith(prefix) and hasattr(md, "size")}
        absent = [key for key in expected if key not in there]
        extra = [key for key in there if key not in expected and not fmt.ignored(key, patterns)]
        shapes = [f"{k} {list(there[k])} vs {list(v)}" for k, v in expected.items() if k in there and there[k] != v]
        problems = [
            f"{label}: {', '.join(keys[:_NAMED])}{' ...' if len(keys) > _NAMED else ''}"
            for label, keys in (
                ("not in the checkpoint", absent),
                ("only in the checkpoint", extra),
                ("shapes differ (checkpoint vs notebook)", shapes),
            )
            if keys
        ]
        if problems:
            raise UsageError(f"{name} does not match the checkpoint's {name}: {'; '.join(problems)}")
    return models


def _made_on_the_ranks(manifest: Manifest, wanted: dict[str, str], namespace: dict[str, Any]) -> set[str]:
    """The checkpoint's optimizers the notebook has no object of that its manifest says how to build (a cell
    made them on the ranks, over a model living there): the ranks build them again under their names."""
    return {
        name
        for name in wanted
        if name not in namespace and name in manifest.recipes and recipe_class(manifest.recipes[name])
    }


def _notebook_optimizers(
    wanted: dict[str, str], models: dict[str, nn.Module], namespace: dict[str, Any], rebuilt: set[str]
) -> dict[str, str]:
    missing = [name for name in wanted if name not in rebuilt and not isinstance(namespace.get(name), Optimizer)]
    if missing:
        raise UsageError(
            f"the checkpoint's optimizers {', '.join(missing)} are not optimizers in the notebook: build them "
            "over the model's parameters first, or skip them with --load-ignore-keys 'optimizers.*'"
        )
    for name, owner in wanted.items():
        if name in rebuilt:
            continue
        params = {id(p) for group in namespace[name].param_groups for p in group["params"]}
        if not params <= {id(p) for p in models[owner].parameters()}:
            raise UsageError(f"{name} does not optimize {owner}'s parameters, as the checkpoint's {name} did")
    return dict(wanted)


def _notebook_schedulers(
    manifest: Manifest, optimizers: dict[str, str], namespace: dict[str, Any], patterns: list[str], rebuilt: set[str]
) -> dict[str, str]:
    wanted = {
        name: opt
        for name, opt in manifest.schedulers.items()
        if opt in optimizers and not fmt.ignored(f"schedulers.{name}", patterns)
    }
    unbuilt = [name for name, opt in wanted.items() if opt in rebuilt and name not in namespace]
    if unbuilt:  # an LR scheduler keeps no recipe (its lambdas, its optimizer): a cell builds it again
        print(
            f"nbfsdp: not loaded: {', '.join(unbuilt)} (LR schedulers a cell made on the ranks: the cell that made "
            "them makes them again, from its first step)",
            file=sys.stderr,
        )
        wanted = {name: opt for name, opt in wanted.items() if name not in unbuilt}
    wrong = [n for n, opt in wanted.items() if getattr(namespace.get(n), "optimizer", 0) is not namespace.get(opt)]
    if wrong:
        raise UsageError(
            f"the checkpoint's schedulers {', '.join(wrong)} are not schedulers of "
            f"{', '.join(wanted[n] for n in wrong)} in the notebook: build them first, or skip them with "
            "--load-ignore-keys 'schedulers.*'"
        )
    return wanted


def _loader_positions(directory: Path, names: list[str]) -> dict[str, LoaderState]:
    """Rank 0's position of each loader, read in the kernel (every rank shuffled alike)."""
    if not names:
        return {}
    state: dict[str, Any] = {"loaders": {"rank0": dict.fromkeys(names)}}
    dcp_load_in_one_process(state, FileSystemReader(str(directory)))
    return state["loaders"]["rank0"]


# ------------------------------------------------------------------ list
def checkpoints(folder: str | os.PathLike) -> list[CheckpointInfo]:
    """The checkpoints under ``folder``, complete or not, oldest first (``%fsdp checkpoints FOLDER``)."""
    try:
        return fmt.list_checkpoints(Path(folder).expanduser())
    except CheckpointError as error:
        raise _usage(error) from None


def table(infos: list[CheckpointInfo]) -> str:
    """``%fsdp checkpoints`` as text: one row a checkpoint."""
    rows = [("name", "step", "world size", "complete", "size", "when")]
    for info in infos:
        rows.append(
            (
                info.name,
                "" if info.step is None else str(info.step),
                "" if info.world_size is None else str(info.world_size),
                "yes" if info.complete else "no (incomplete)",
                size_text(info.bytes),
                info.created,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
