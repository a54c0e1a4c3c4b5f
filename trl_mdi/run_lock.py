"""One run per output directory: an advisory lock the main process of a run holds on ``<output_dir>/.trl_mdi.lock``.

Why ``fcntl.flock`` on an open file rather than a pid file: the kernel releases the lock when the process dies, however
it dies (``kill -9``, out of memory, a node reboot), so a crashed run never leaves it stuck and no one has to decide
whether a recorded pid on some host is still the same process (pids are reused; another host's cannot be checked).
The file also holds the holder's pid, host and start time, only to name it in the error. On NFS, Linux maps flock to
the server's byte-range locks (NLM); a filesystem that refuses locks gets a warning and the run goes on unlocked.

One lock per *run*, not per process: under ``accelerate launch`` only the main process (``process_index`` 0) takes it.
Within one process the lock is re-entrant (a second trainer built in the same process, as tests and notebooks do,
shares it): it guards against another launch, not against the same script building two trainers.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from pathlib import Path

LOCK_NAME = ".trl_mdi.lock"
_HELD: dict[str, list] = {}  # real path of the lock file -> [fd, holders in this process]


class RunLockedError(RuntimeError):
    """Another live run holds the output directory's lock."""


class RunLock:
    """The lock on one output directory, held until :meth:`release` (or the process ends)."""

    def __init__(self, key: str | None):
        self.key = key

    def release(self) -> None:
        """Drop this holder; the file lock goes when the last holder in this process releases it."""
        key, self.key = self.key, None
        held = _HELD.get(key) if key else None
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                os.close(held[0])


def lock_output_dir(output_dir: str | os.PathLike) -> RunLock:
    """Take the run's lock on ``output_dir`` (created if needed), or raise :class:`RunLockedError` naming the run that
    holds it and what to do."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the run goes on unlocked
        return RunLock(None)
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    key = os.path.realpath(path)
    if key in _HELD:
        _HELD[key][1] += 1
        return RunLock(key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 500, 0).decode("utf-8", "replace").strip() or "a run that has not written its name yet"
        os.close(fd)
        raise RunLockedError(
            f"output_dir {str(folder)!r} is in use by another run ({holder}; lock {path}). Two runs in one output_dir "
            "overwrite each other's checkpoints: give this run another --output_dir, or wait for that one to end"
        ) from None
    except OSError as e:  # a filesystem without locks (ENOLCK, EINVAL...)
        os.close(fd)
        warnings.warn(f"trl_mdi: cannot lock {path} ({e.strerror or e}); nothing stops a second run from writing "
                      "into this output_dir", RuntimeWarning, stacklevel=2)
        return RunLock(None)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: "
                   f"{' '.join(sys.argv)[:300]}\n").encode("utf-8", "replace"), 0)
    _HELD[key] = [fd, 1]
    return RunLock(key)


__all__ = ["LOCK_NAME", "RunLock", "RunLockedError", "lock_output_dir"]
