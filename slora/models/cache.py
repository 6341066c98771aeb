"""The slora cache folder, and the one way things are made in it: once, and all or nothing.

A cached thing (a converted GGUF model, the tiny test model) is built in a staging folder beside its place
and published with one rename, under a file lock: a build that is interrupted (an exception, Ctrl-C, a
kill) never leaves a folder that a later start would take for a complete one, and processes that start
together build it once.
"""
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

COMPLETE_MARKER = "complete"
_STAGING_PREFIX = ".building-"


def cache_root() -> Path:
    """The slora cache folder: $SLORA_CACHE, or ~/.cache/slora."""
    base = os.environ.get("SLORA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "slora")
    return Path(base)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, made first by `build(staging_folder)` if it is not complete yet."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not _is_complete(target):           # another process may have built it while we waited
            _remove_stale(target)
            _build_atomically(target, build)
    return target


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _remove_stale(target: Path) -> None:
    """Staging folders of builds that were killed (we hold the lock, so none is running), and a target
    without its marker, which is no complete build."""
    for stale in target.parent.glob(f"{_STAGING_PREFIX}{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{_STAGING_PREFIX}{target.name}-"))
    try:
        build(staging)
        (staging / COMPLETE_MARKER).write_text(target.name)
        os.replace(staging, target)
    finally:                                   # after a failure or an interrupt, nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
