"""Private spill directories: one per engine process, named after its PID, so the next
start can remove what a killed process (kill -9, a crash) left behind."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import tempfile

logger = logging.getLogger(__name__)

PREFIX = "metrale-spill-"
_OWNED = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")


def make_private_dir(parent: str | None = None) -> str:
    """A fresh spill directory for this process (removed by the engine on close)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_dirs(parent: str | None = None) -> list[pathlib.Path]:
    """Remove the private spill directories whose process is gone; returns them. A live
    owner (or a PID reused since) keeps its directory: the safe side of the doubt."""
    removed = []
    root = pathlib.Path(parent or tempfile.gettempdir())
    for path in root.glob(f"{PREFIX}*"):
        match = _OWNED.match(path.name)
        if not match or not path.is_dir() or _alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d spill directories left by processes that are gone: %s",
                    len(removed), ", ".join(p.name for p in removed))
    return removed
