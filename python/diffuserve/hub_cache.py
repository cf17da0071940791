"""Checkpoints named by their Hugging Face Hub id, found in the local Hugging Face cache.

diffuserve downloads nothing. `diffuserve serve google/diffusiongemma-26B-A4B-it` serves the
snapshot that `hf download` (or transformers) left in the cache, as transformers finds it
offline: the cache's `models--ORG--NAME/refs/main` names the snapshot folder. A path that
exists is always a path, whatever it looks like.
"""
import os
import re
from pathlib import Path

from . import _core

# An id as the Hub spells them: NAME or ORG/NAME, letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"(?:\w[\w.-]*/)?\w[\w.-]*", re.ASCII)


def cache_dir() -> Path:
    """Where the Hugging Face cache keeps models, as huggingface_hub finds it (its variables'
    ~ and $VARS expanded, HUGGINGFACE_HUB_CACHE its older name for HF_HUB_CACHE)."""
    def path(text: str) -> Path:
        return Path(os.path.expandvars(text)).expanduser()

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return path(os.environ[name])
    if os.environ.get("HF_HOME"):
        return path(os.environ["HF_HOME"]) / "hub"
    return path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface" / "hub"


def resolve_checkpoint(path: str) -> str:
    """`path` itself where it exists or cannot be a Hub id; else the cached snapshot of the
    model of that id, or CheckpointError saying where it was looked for."""
    if os.path.lexists(path) or not _REPO_ID.fullmatch(path) or path.endswith(".") or ".." in path:
        return path
    repo = cache_dir() / ("models--" + path.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        snapshot = snapshots / commit if commit else None
    else:  # (a cache filled by commit hash alone keeps no refs/main: its one snapshot)
        found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
        snapshot = found[0] if len(found) == 1 else None
        if len(found) > 1:
            raise _core.CheckpointError(
                f"'{path}' is not a checkpoint directory, and the Hugging Face cache holds {len(found)} snapshots of "
                f"it ({snapshots}) but no refs/main to choose one: give the snapshot's directory")
    if snapshot is None or not snapshot.is_dir():
        raise _core.CheckpointError(
            f"'{path}' is not a checkpoint directory, nor a model in the Hugging Face cache ({cache_dir()}; "
            f"HF_HUB_CACHE or HF_HOME move it). diffuserve downloads nothing: fetch it first (hf download {path})")
    return str(snapshot)
