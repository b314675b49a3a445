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

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from ipyparallel import error as ipp_error
from IPython import get_ipython
from IPython.core.error import UsageError
from torch.distributed.checkpoint import FileSystemReader
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from nbfsdp.engines import checkpointing
from nbfsdp.kernel import history
from nbfsdp.kernel.cluster import MAX_WORLD_SIZE, World
from nbfsdp.kernel.runner import LIVENESS_SECONDS, RankError
from nbfsdp.kernel.session import Session
from nbfsdp.shared import checkpoints as fmt
from nbfsdp.shared.checkpoints import CheckpointError, CheckpointInfo, Manifest
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import CheckpointSettings, FSDPConfig
from nbfsdp.shared.protocol import LoaderState

#: How many differing keys an error names.
_NAMED = 5
DEFAULT_TIMEOUT_SECONDS = 30.0


def _session() -> Session:
    """The notebook's session, for the functions (``nbfsdp.save`` ...); the magics pass theirs."""
    shell = get_ipython()
    magics = shell.magics_manager.registry.get("FSDPMagics") if shell is not None else None
    if magics is None:
        raise UsageError("nbfsdp is not loaded (or still loading in the background): run %load_ext nbfsdp first")
    return magics.session


def _usage(error: CheckpointError) -> UsageError:
    return UsageError(str(error))


# ------------------------------------------------------------------ save
def save(path: str | os.PathLike, overwrite: bool = False) -> Manifest:
    """Save what the engines hold now as a sharded checkpoint at ``path`` (``%fsdp save PATH``).

    Every sharded model of the running world, the optimizers and LR schedulers the cells left on the
    ranks, each rank's RNG states and split DataLoaders' positions; each rank writes only its own shards.
    The checkpoint appears under ``path`` only once complete. Returns its manifest.
    """
    return save_with(_session(), path, overwrite)


def _resume_step() -> int | None:
    """The step after the last ``nbfsdp.log(step=...)`` of the last run: where training resumes."""
    run = history.last_run()
    steps = [m["step"] for m in run.metrics if m.get("rank") == 0 and m.get("step") is not None] if run else []
    return max(steps) + 1 if steps else None


def save_with(session: Session, path: str | os.PathLike, overwrite: bool) -> Manifest:
    if session.active is not None:
        raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then save")
    world = session.cluster.world
    if world is None or world.broken:
        raise UsageError("nothing to save: no world is running (run a %%fsdp cell, or %fsdp load a checkpoint)")
    if not session.engine_models():
        raise UsageError("nothing to save: the engines hold no model (run a %%fsdp cell that reads one)")
    final = Path(path).expanduser().resolve()  # the engines may run in another directory
    try:
        fmt.check_target(final, overwrite)
    except CheckpointError as error:
        raise _usage(error) from None
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = fmt.partial_path(final)
    args = (world.generation, str(partial), str(final), _resume_step(), overwrite)
    results = _on_every_rank(session, world, checkpointing.save, args, "saving", partial)
    text, skipped = results[0]
    manifest = Manifest.from_json(text)
    if skipped:
        print(f"nbfsdp: not saved: {'; '.join(f'{n} ({why})' for n, why in skipped.items())}", file=sys.stderr)
    written = ", ".join(size_text(b) for b in manifest.bytes_per_rank)
    step = f"step {manifest.step}" if manifest.step is not None else "no step logged"
    print(
        f"nbfsdp: saved {path} ({step}, {manifest.world_size} ranks wrote {written}): models "
        f"{', '.join(manifest.models)}; optimizers {', '.join(manifest.optimizers) or 'none'}; "
        f"schedulers {', '.join(manifest.schedulers) or 'none'}"
    )
    return manifest


def _on_every_rank(session: Session, world: World, function: Any, args: tuple, doing: str, partial: Path) -> list:
    """Run ``function(*args)`` on every rank at once; their results by rank.

    A rank that dies breaks the world (its peers wait in a collective): the error says so at once. A
    ``CheckpointError`` every rank raised together is the user's: a ``UsageError``, the world intact.
    """
    client = session.cluster.client
    results = [client[engine_id].apply_async(function, *args) for engine_id in world.engine_ids]

    def died() -> RankError | None:
        dead = session.cluster.dead_ranks()
        if not dead:
            return None
        world.broken = True
        rank, how = next(iter(dead.items()))
        left = f"; {partial.name} was left incomplete in {partial.parent} (safe to delete)" if partial.exists() else ""
        return RankError(rank, f"engine died while {doing}: {how}{left}")

    for result in results:
        while not result.ready():
            result.wait(LIVENESS_SECONDS)
            if not result.ready() and (error := died()):
                raise error
    answers = []
    for rank, result in enumerate(results):
        try:
            answers.append(result.get())
        except (ipp_error.RemoteError, ipp_error.EngineError) as error:
            if getattr(error, "ename", "") == "CheckpointError":
                raise UsageError(error.evalue) from None
            if death := died():  # a peer's death is what made this rank fail: name that one
                raise death from None
            if getattr(error, "ename", "") != "CheckpointException":
                world.broken = True  # the ranks may disagree on where they are now: the next cell starts afresh
            # else DCP's own error (a full disk ...), which it hands every rank together: the world goes on
            what = f"{error.ename}: {error.evalue}" if hasattr(error, "ename") else str(error)
            left = f"; {partial.name} was left incomplete (safe to delete)" if partial.exists() else ""
            raise RankError(rank, f"{what} (while {doing}){left}") from None
    return answers


# ------------------------------------------------------------------ load
def load(
    path: str | os.PathLike, world_size: int | None = None, load_ignore_keys: list[str] | str | None = None
) -> Manifest:
    """Load a checkpoint into the running world, or a fresh one of ``world_size`` ranks (``%fsdp load``).

    The default world size is the running world's, or with none running the checkpoint's. The models,
    optimizers and schedulers of the checkpoint's names in the notebook take the loaded state in place;
    at the world size that saved it, each rank's RNG states and the loaders' positions carry over too.
    ``load_ignore_keys``: globs on the DCP keys to skip (``"optimizers.*"``; an optimizer skipped skips
    its scheduler). Returns the checkpoint's manifest.
    """
    return load_with(_session(), path, world_size, load_ignore_keys)


def load_with(
    session: Session,
    path: str | os.PathLike,
    world_size: int | None,
    ignore: list[str] | str | None,
    *,
    config: FSDPConfig | None = None,
    timeout: float | None = None,
) -> Manifest:
    """``config`` and ``timeout``: the settings of the cell the load runs before (``--load-path``,
    ``--autoresume``), so that cell finds the world and the sharded models as the load left them; by
    default the checkpoint's settings and the running world's timeout."""
    if session.active is not None:
        raise UsageError("a cell is running: `%fsdp wait` for it (or `%fsdp cancel`), then load")
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
    optimizers = _notebook_optimizers(kept_optimizers, models, namespace)
    schedulers = _notebook_schedulers(manifest, optimizers, namespace, patterns)
    running = session.cluster.world
    if world_size is None:
        world_size = running.world_size if running and not running.broken else manifest.world_size
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    same = world_size == manifest.world_size
    if not same:
        print(
            f"nbfsdp: saved at world size {manifest.world_size}, loading at {world_size}: RNG states and data "
            "positions do not carry over (models, optimizers and schedulers do)"
        )
    if config is None:
        first = next(iter(manifest.models.values()))
        config = FSDPConfig(**{**first["fsdp"], "wrap_cls": tuple(first["fsdp"]["wrap_cls"])})
    cell = (
        '__import__("nbfsdp.engines.checkpointing", fromlist=["load_into"]).load_into('
        f"{str(directory)!r}, {{{', '.join(f'{n!r}: {n}' for n in models)}}}, "
        f"{{{', '.join(f'{n!r}: ({n}, {o!r})' for n, o in optimizers.items())}}}, "
        f"{{{', '.join(f'{n!r}: {n}' for n in schedulers)}}}, {patterns!r}, {same!r})\n"
    )
    if timeout is None:
        timeout = running.timeout if running and not running.broken else DEFAULT_TIMEOUT_SECONDS
    session.run_cell(cell, world_size=world_size, timeout=timeout, gather=True, config=config, internal=True)
    loaders = [n for n in manifest.loaders if same and not fmt.ignored(f"loaders.rank0.{n}", patterns)]
    session.loader_resume = {}
    for name, state in _loader_positions(directory, loaders).items():
        if isinstance(namespace.get(name), DataLoader):
            session.restore_loader(namespace[name], state)
            if getattr(state, "taken", 0):  # saved part-way through an epoch: the next cell goes on there
                session.loader_resume[name] = state
    step = f"step {manifest.step}" if manifest.step is not None else "no step"
    print(
        f"nbfsdp: loaded {path} ({step}) into {world_size} ranks: models {', '.join(models)}; "
        f"optimizers {', '.join(optimizers) or 'none'}; schedulers {', '.join(schedulers) or 'none'}"
    )
    session.resume_step = manifest.step or 0  # the next cell's resume_step
    return manifest


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
    load_with(session, path, world_size, settings.load_ignore_keys, config=config, timeout=timeout)


def _notebook_models(
    manifest: Manifest, namespace: dict[str, Any], saved: dict[str, Any], patterns: list[str]
) -> dict[str, nn.Module]:
    """The notebook's models of the checkpoint's names, each checked key by key and shape by shape."""
    missing = [name for name in manifest.models if not isinstance(namespace.get(name), nn.Module)]
    if missing:
        raise UsageError(
            f"the checkpoint's models {', '.join(missing)} are not nn.Modules in the notebook: build them "
            f"(e.g. {manifest.models[missing[0]]['class']}) under those names first, then load"
        )
    models = {name: namespace[name] for name in manifest.models}
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
            )  # fmt: skip
            if keys
        ]
        if problems:
            raise UsageError(f"{name} does not match the checkpoint's {name}: {'; '.join(problems)}")
    return models


def _notebook_optimizers(
    wanted: dict[str, str], models: dict[str, nn.Module], namespace: dict[str, Any]
) -> dict[str, str]:
    missing = [name for name in wanted if not isinstance(namespace.get(name), Optimizer)]
    if missing:
        raise UsageError(
            f"the checkpoint's optimizers {', '.join(missing)} are not optimizers in the notebook: build them "
            "over the model's parameters first, or skip them with --load-ignore-keys 'optimizers.*'"
        )
    for name, owner in wanted.items():
        params = {id(p) for group in namespace[name].param_groups for p in group["params"]}
        if not params <= {id(p) for p in models[owner].parameters()}:
            raise UsageError(f"{name} does not optimize {owner}'s parameters, as the checkpoint's {name} did")
    return dict(wanted)


def _notebook_schedulers(
    manifest: Manifest, optimizers: dict[str, str], namespace: dict[str, Any], patterns: list[str]
) -> dict[str, str]:
    wanted = {
        name: opt
        for name, opt in manifest.schedulers.items()
        if opt in optimizers and not fmt.ignored(f"schedulers.{name}", patterns)
    }
    wrong = [n for n, opt in wanted.items() if getattr(namespace.get(n), "optimizer", None) is not namespace[opt]]
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
    with warnings.catch_warnings():  # DCP warns that it loads in one process: here that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
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
