"""What a model path names (a local directory or a Hugging Face Hub repo), and the local checkpoint
directory it resolves to; where `build_tiny_if_missing` may build.

A path (`model.path`, `reward_model.path`, the CHECKPOINT of `zrl eval` / `zrl ttc`) is either
- a local directory: any path that exists here, or that cannot be a repo id (absolute, starting with
  `./` or `~`, more than one `/`, or a single name). It is used as it is; or
- a Hub repo id `org/name` (huggingface_hub's own validation) that is not an existing path: a local
  directory of that name wins, and `./org/name` names a local directory that does not exist yet. It
  resolves to the snapshot of `revision` (default `main`; a branch, tag or commit) in the Hugging Face
  cache (HF_HUB_CACHE, by default ~/.cache/huggingface/hub). A cached snapshot is used without asking
  the Hub, so a cached `main` stays what was downloaded until `hf download` fetches a newer one; an
  uncached repo is downloaded on first use, unless HF_HUB_OFFLINE is set: then it is an error whose one
  line holds the `hf download` command that fetches it.

Everything downstream (trainer, rollout engines, tokenizer, reward-model actors) receives the resolved
local directory, never the repo id. On several nodes that directory must exist at the same path on every
node, as any local model path must: keep the Hugging Face cache on shared storage (HF_HUB_CACHE).

Scratch assets. `build_tiny_if_missing` writes a tiny random model, which must never stand in for a real
checkpoint that is merely not downloaded yet. It builds only at a *scratch asset path*: a local path (not
a repo id) whose last component starts with SCRATCH_PREFIX (as the shipped `runs/assets/tiny-zaya`) and
that does not exist or is an empty directory. Anywhere else a missing checkpoint is an error.

huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported (huggingface_hub.constants);
this module reads them from there, so it always agrees with the library that does the downloading.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("zrl")

SCRATCH_PREFIX = "tiny-"  # the last path component of a directory build_tiny_if_missing may build in


class ModelPathError(FileNotFoundError):
    """A path that names no usable checkpoint here. The message is one line: `<field>: <reason>`."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class Location:
    """Where the checkpoint a path names is, found without downloading anything."""

    path: str  # as the user wrote it
    repo_id: str | None  # set when `path` names a Hub repo
    revision: str | None  # the requested revision (None: the default branch)
    local: Path | None  # the directory to read; None while a repo has yet to be downloaded
    missing: str | None = None  # why a repo cannot be had here (offline, not cached); one line

    @property
    def commit(self) -> str | None:
        """The commit of a cached snapshot (the cache names snapshot directories by commit)."""
        return self.local.name if self.repo_id and self.local else None

    def describe(self) -> str:
        """One line for `zrl validate`: which directory a run would read."""
        if self.repo_id is None:
            return f"local directory {self.path}"
        where = f"Hugging Face repo {self.repo_id} (revision {self.revision or default_revision()})"
        if self.local is not None:
            return f"{where}: cached snapshot {self.local} (commit {self.commit})"
        if self.missing is not None:
            return f"{where}: not in the Hugging Face cache ({cache_dir()}), and HF_HUB_OFFLINE is set: missing"
        return f"{where}: not in the Hugging Face cache ({cache_dir()}); downloaded from the Hub on first use"


def is_hub_id(path: str) -> bool:
    """Whether `path` names a Hub repo: `org/name`, valid for huggingface_hub, and no existing path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.count("/") != 1 or Path(path).exists():
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def default_revision() -> str:
    from huggingface_hub import constants

    return constants.DEFAULT_REVISION


def offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def download_command(repo_id: str, revision: str | None) -> str:
    return f"hf download {shlex.quote(repo_id)}" + (f" --revision {shlex.quote(revision)}" if revision else "")


def locate(path: str, revision: str | None, field: str) -> Location:
    """Where the checkpoint `path` names is, from the local cache only. Raises ModelPathError for a
    `revision` given with a local directory (it would be ignored)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    if not is_hub_id(path):
        if revision is not None:
            raise ModelPathError(field, f"{path} is a local directory; a revision ({revision}) applies to Hugging "
                                        f"Face repo ids only")
        return Location(path, None, None, Path(path).expanduser())
    try:
        return Location(path, path, revision, Path(snapshot_download(path, revision=revision, local_files_only=True)))
    except LocalEntryNotFoundError as exc:  # not cached, or only partly (IncompleteSnapshotError)
        if not offline():
            return Location(path, path, revision, None)
        state = ("is only partly in the Hugging Face cache" if isinstance(exc, IncompleteSnapshotError)
                 else "is neither a local directory nor in the Hugging Face cache")
        return Location(path, path, revision, None,
                        missing=f"{path} {state} ({cache_dir()}), and HF_HUB_OFFLINE is set; download it with: "
                                f"{download_command(path, revision)}")


def resolve(path: str, revision: str | None, field: str) -> Path:
    """The local directory `path` names (module docstring), downloading a repo that is not cached yet.
    Raises ModelPathError (one line) when it cannot be had."""
    where = locate(path, revision, field)
    if where.missing is not None:
        raise ModelPathError(field, where.missing)
    if where.local is not None:
        if where.repo_id is not None:
            log.info("%s: %s", field, where.describe())
        return where.local
    return _download(path, revision, field)


def _download(repo_id: str, revision: str | None, field: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    log.info("%s: downloading %s (revision %s) from the Hugging Face Hub into %s", field, repo_id,
             revision or default_revision(), cache_dir())
    try:
        local = Path(snapshot_download(repo_id, revision=revision))
    except RevisionNotFoundError as exc:
        raise ModelPathError(field, f"the Hugging Face repo {repo_id} has no revision {revision!r}") from exc
    except RepositoryNotFoundError as exc:  # also a gated or private repo without a token
        raise ModelPathError(field, f"{repo_id} is no local directory, and no Hugging Face repo this machine can "
                                    f"read (a gated or private one needs `hf auth login`)") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:  # no connection, Hub down, disk full
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelPathError(field, f"downloading {repo_id} from the Hugging Face Hub failed ({type(exc).__name__}: "
                                    f"{first}); download it with: {download_command(repo_id, revision)}") from exc
    log.info("%s: %s is snapshot %s (commit %s)", field, repo_id, local, local.name)
    return local


def scratch_refusal(path: str | Path, what: str) -> str | None:
    """Why build_tiny_if_missing may not build at `path`, a path holding no `what` (one line), or None
    when it is a scratch asset path (module docstring)."""
    rule = (f"build_tiny_if_missing builds only in a new or empty directory whose name starts with "
            f"{SCRATCH_PREFIX!r} (as runs/assets/tiny-zaya)")
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        return f"{path} exists and is not a directory (build_tiny_if_missing would build the tiny model there)"
    if not local.name.startswith(SCRATCH_PREFIX):
        return f"{path} is not a {what}, and {rule}"
    if local.is_dir() and any(local.iterdir()):
        return f"{path} is not a {what} and is not empty; {rule} (remove it to rebuild the tiny model)"
    return None


def local_checkpoint(field: str, path: str, revision: str | None, is_checkpoint: Callable[[Path], bool],
                     what: str, build_tiny: Callable[[Path], object] | None = None) -> Path:
    """The local checkpoint directory `path` names, downloading a repo that is not cached yet. With
    `build_tiny` (the recipe's build_tiny_if_missing), a checkpoint missing at a scratch asset path is
    built there by it first. `what` names the kind of checkpoint in messages. Raises ModelPathError."""
    local = resolve(path, revision, field)
    if is_checkpoint(local):
        return local
    if is_hub_id(path):
        raise ModelPathError(field, f"{local} (the cached snapshot of {path}) is not a {what}")
    if build_tiny is None:
        raise ModelPathError(field, f"{path} is not a {what} and build_tiny_if_missing is false")
    refusal = scratch_refusal(local, what)
    if refusal is not None:
        raise ModelPathError(field, refusal)
    log.info("%s: building the tiny CPU model at %s", field, local)
    build_tiny(local)
    return local
