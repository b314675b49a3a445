"""The checkpoint format, its manifest, and writing and listing checkpoints atomically.

Shared by the ranks (which write a checkpoint) and the kernel (which lists, checks and loads one).

The format (version 1):

- A checkpoint is a directory: the path the user names (``%fsdp save ckpt/manual`` is ``ckpt/manual/``;
  interval saves use ``<save_folder>/step-<N>/``). It holds DCP's files (``*.distcp``, ``.metadata``) and
  ``nbfsdp.json``, the manifest. It is *complete* iff its name does not start with ``.`` and
  ``nbfsdp.json`` exists.
- Written atomically: every rank writes (DCP) into ``<parent>/.<name>.partial-<hex>/``; once ``dcp.save``
  has returned on every rank, rank 0 writes ``nbfsdp.json`` (tmp + fsync + rename), then renames the
  directory to ``<parent>/<name>`` and fsyncs the parent. An existing complete ``<name>`` is an error
  unless ``overwrite`` (then the old one is moved aside and removed only after the rename).
- The DCP state dict, nested (DCP flattens it with dots)::

      {"models": {name: get_model_state_dict(module)},
       "optimizers": {name: get_optimizer_state_dict(module, optimizer)},
       "schedulers": {name: scheduler.state_dict()},
       "rng": {f"rank{r}": {"torch": ByteTensor, "numpy": <np state>, "python": <random state>, "cuda": ...}},
       "loaders": {f"rank{r}": {loader_name: LoaderState}}}

  Model keys are FQNs as ``get_model_state_dict`` gives them (the plain model's ``state_dict()`` keys).
  Per-rank values live under rank-specific keys: DCP writes a value that is not sharded once.
- The manifest ``nbfsdp.json`` is a ``Manifest`` as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fnmatch
import importlib.metadata
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1
MANIFEST = "nbfsdp.json"
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-[0-9a-f]+$")
_RANK_FILE = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked (shown as a ``UsageError`` in the notebook)."""


#: Free space under which a failed write counts as a full disk (a write fills the disk before it fails).
FULL_BELOW_BYTES = 1 << 20


def is_disk_full(error: BaseException, directory: str | os.PathLike | None = None) -> bool:
    """``error`` (or, from any rank, what DCP's ``CheckpointException`` wraps) is a full disk.

    ``ENOSPC`` itself, or, with ``directory``, a failed write while its file system has (almost) no space
    left: ``torch.save``'s zip writer, which DCP uses for non-tensor values, reports ``ENOSPC`` as a short
    write ("unexpected pos") and loses the errno.
    """
    failures = getattr(error, "failures", None)
    errors = [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()] if failures else [error]
    chained = []
    for item in errors:
        while item is not None and item not in chained:
            chained.append(item)
            item = item.__cause__ or item.__context__
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e) for e in chained):
        return True
    if directory is None or not any(isinstance(e, (OSError, RuntimeError)) for e in chained):
        return False
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < FULL_BELOW_BYTES


def disk_full(partial: str | os.PathLike, then: str, *, remove: bool) -> CheckpointError:
    """After ``ENOSPC`` mid-save: the error to raise; ``remove`` (one rank, once every rank is past its
    writes) deletes the partial directory, so the space it took goes back to the user."""
    partial = Path(partial)
    if remove:
        shutil.rmtree(partial, ignore_errors=True)
    return CheckpointError(f"no space left on device in {partial.parent}: nothing was saved; {then}")


@dataclass(kw_only=True)
class Manifest:
    """What a checkpoint holds, written last: its presence makes the checkpoint complete."""

    format: int = FORMAT
    step: int | None
    """The step training resumes at (the last ``nbfsdp.log`` step + 1), or None when unknown."""
    world_size: int
    created: str
    """ISO time the checkpoint was completed."""
    torch: str
    nbfsdp: str
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> {"class": qualified class name, "parameters": count, "fsdp": the FSDPConfig's fields}."""
    optimizers: dict[str, str] = field(default_factory=dict)
    """optimizer name -> the model name its parameters belong to."""
    schedulers: dict[str, str] = field(default_factory=dict)
    """scheduler name -> its optimizer's name."""
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """optimizer name -> how to build it again where the notebook has none (one a cell made on the ranks):
    {"class": its qualified class name, "groups": each param group's FQNs in its model and hyperparameters}."""
    loaders: list[str] = field(default_factory=list)
    bytes_per_rank: list[int] = field(default_factory=list)
    """Bytes of DCP data files each rank wrote."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint format {data.get('format')!r}; this nbfsdp reads format {FORMAT}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(kw_only=True)
class CheckpointInfo:
    """One row of ``%fsdp checkpoints``."""

    name: str
    path: str
    complete: bool
    step: int | None
    world_size: int | None
    bytes: int
    created: str
    """ISO time: the manifest's, or the directory's modification time for an incomplete one."""


def nbfsdp_version() -> str:
    try:
        return importlib.metadata.version("nbfsdp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return not path.name.startswith(".") and (path / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of a complete checkpoint; ``CheckpointError`` saying why a path is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not is_complete(path):
        if (path / ".metadata").exists() or any(path.glob("*.distcp")) or path.name.startswith("."):  # DCP's files
            raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}: its save did not finish)")
        raise CheckpointError(
            f"{path}: not a checkpoint: no {MANIFEST} (nbfsdp's) and no model.safetensors or "
            "model.safetensors.index.json (a Hugging Face checkpoint's)"
        )
    return Manifest.from_json((path / MANIFEST).read_text())


def partial_path(final: str | os.PathLike) -> Path:
    """Where a save of ``final`` writes until it completes: a hidden sibling no listing calls complete."""
    final = Path(final)
    return final.parent / f".{final.name}.partial-{secrets.token_hex(4)}"


def bytes_per_rank(directory: str | os.PathLike[str], world_size: int) -> list[int]:
    """Bytes of the data files each rank wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    written = [0] * world_size
    for entry in os.scandir(directory):
        if (match := _RANK_FILE.match(entry.name)) and int(match["rank"]) < world_size:
            written[int(match["rank"])] += entry.stat().st_size
    return written


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish(partial: str | os.PathLike, final: str | os.PathLike, manifest: Manifest, *, overwrite: bool) -> None:
    """Complete a checkpoint every rank has written: the manifest, then the rename (rank 0 only).

    The manifest is written to a temporary file, synced and renamed, so a half-written one never exists;
    the directory then appears under its name in one rename. An old complete checkpoint being overwritten
    is moved aside first and removed only once the new one is in place.
    """
    partial, final = Path(partial), Path(final)
    temporary = partial / f".{MANIFEST}.tmp"
    with open(temporary, "w") as file:
        file.write(manifest.to_json())
        file.flush()
        os.fsync(file.fileno())
    os.rename(temporary, partial / MANIFEST)
    _fsync_dir(partial)
    aside = None
    if final.exists():
        check_target(final, overwrite=overwrite)  # again: another save may have completed since the kernel looked
        aside = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, aside)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def check_target(final: str | os.PathLike, *, overwrite: bool) -> None:
    """Before a save: refuse a complete checkpoint in the way (unless ``overwrite``) and a file there."""
    final = Path(final)
    if final.name.startswith("."):
        raise CheckpointError(f"{final}: a checkpoint's name may not start with '.' (it would never be complete)")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final}: a file is there, not a checkpoint directory")
    if final.is_dir() and not _replaceable(final):
        raise CheckpointError(
            f"{final}: a directory with other files than a checkpoint's is there; save somewhere else"
        )
    if is_complete(final) and not overwrite:
        raise CheckpointError(
            f"{final}: a complete checkpoint is there already; --overwrite (overwrite=True) replaces it"
        )


def _replaceable(path: Path) -> bool:
    """Only a checkpoint (complete or not) or an empty directory is ever replaced: never the user's data."""
    names = {MANIFEST, ".metadata", f".{MANIFEST}.tmp"}
    return all(entry.is_file() and (entry.name in names or entry.name.endswith(".distcp")) for entry in path.iterdir())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_checkpoints(folder: str | os.PathLike) -> list[CheckpointInfo]:
    """Every checkpoint directly under ``folder``, complete or not, oldest first.

    A directory with DCP files or a manifest counts; a ``.<name>.partial-<hex>`` one (a save that did not
    finish, or one running now) is listed as incomplete under ``<name>``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    found = []
    for path in folder.iterdir():
        if not path.is_dir():
            continue
        partial = _PARTIAL.match(path.name)
        if path.name.startswith(".") and not partial:
            continue  # an old checkpoint being replaced, or anything else hidden
        if not partial and not (path / MANIFEST).exists() and not any(path.glob("*.distcp")):
            continue  # not a checkpoint
        manifest = None
        if is_complete(path):
            with contextlib.suppress(CheckpointError, ValueError, TypeError):
                manifest = read_manifest(path)
        modified = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
        found.append(
            CheckpointInfo(
                name=partial["name"] if partial else path.name,
                path=str(path),
                complete=manifest is not None,
                step=manifest.step if manifest else None,
                world_size=manifest.world_size if manifest else None,
                bytes=_size(path),
                created=manifest.created if manifest else modified.isoformat(timespec="seconds"),
            )
        )
    return sorted(found, key=lambda info: (info.created, info.name))


def keep_latest(folder: str | os.PathLike, keep: int) -> list[str]:
    """Remove all but the ``keep`` newest complete checkpoints under ``folder`` (``save_num_checkpoints_to_keep``);
    the removed paths.

    Only complete ones are candidates: a save being written is a hidden partial directory, never removed here.
    """
    if keep <= 0:
        return []
    complete = [info for info in list_checkpoints(folder) if info.complete]
    complete.sort(key=lambda info: (info.step if info.step is not None else -1, info.created))
    removed = []
    for info in complete[:-keep]:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    return removed


def newest(folder: str | os.PathLike) -> CheckpointInfo | None:
    """``autoresume``'s pick: the complete checkpoint under ``folder`` of the highest step (then the latest);
    None when there is none, or no folder. A partial directory is never a candidate."""
    if not Path(folder).is_dir():
        return None
    complete = [info for info in list_checkpoints(folder) if info.complete]
    return max(complete, key=lambda info: (info.step if info.step is not None else -1, info.created), default=None)


def ignored(key: str, patterns: list[str]) -> bool:
    """``load_ignore_keys``: a glob skips an entry when it matches the entry's DCP key or the key and a dot
    (so ``optimizers.*`` and ``optimizers.opt.*`` both skip the entry ``'optimizers.opt'``)."""
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(f"{key}.", p) for p in patterns)
