"""Files and folders written whole or not at all: a reader (or a crash) sees the old content
or the whole new one, never a mix. A checkpoint folder is swapped in as one
(:func:`write_folder_atomically`); one file, a data shard or an acceptance.json, is renamed
over its old self (:func:`write_file_atomically`). Written files get the mode the umask
gives, and what a killed writer left behind is cleaned up by the next write to the same name.
"""
import contextlib
import ctypes
import errno
import os
import shutil
import sys
import uuid
from typing import Callable, Dict, Optional, Union

__all__ = ["write_folder_atomically", "write_file_atomically"]


def write_folder_atomically(path: str, files: Dict[str, Union[bytes, Callable[[str], None]]]) -> None:
    """Make `path` a folder holding exactly `files` (name -> bytes, or a callable writing the
    file at the path it is given), atomically: the folder is built as a hidden sibling
    (same parent: the rename stays on one filesystem), flushed to disk, then swapped in
    (:func:`_swap_in`) and the old folder deleted. Whatever `path` held before goes."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_dead_writers_leftovers(parent, name)
    new = _temporary_sibling(parent, name)
    os.mkdir(new)  # not tempfile's: its 0700 would become the checkpoint's mode; this one follows the umask
    try:
        for file_name, content in files.items():
            file_path = os.path.join(new, file_name)
            if isinstance(content, bytes):
                with open(file_path, "wb") as f:
                    f.write(content)
            else:
                content(file_path)
            _follow_umask(file_path)
            _fsync(file_path)
        _fsync_folder(new)
        old = _swap_in(new, path)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _fsync_folder(parent)
    if old is not None:
        _remove(old)


def write_file_atomically(path: str, write: Callable[[str], None]) -> None:
    """Write one file through a hidden temporary sibling (`write(tmp_path)`), flushed to disk
    and renamed over `path`: readers see the old file or the whole new one."""
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    _remove_dead_writers_leftovers(parent, name)
    tmp = _temporary_sibling(parent, name)  # created by `write`, with the mode the umask gives
    try:
        write(tmp)
        _follow_umask(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_folder(parent)


def _umask() -> int:
    """The process's umask (read from /proc on Linux, where reading it does not change it)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow_umask(path: str) -> None:
    """Give a written file the mode a plain open() would: some writers (safetensors' save_file)
    create theirs owner-only, whatever the umask says."""
    os.chmod(path, 0o666 & ~_umask())


def _temporary_sibling(parent: str, name: str) -> str:
    """A fresh hidden name beside `name`; the writer's pid in it tells a later save whether
    the writer is still alive (:func:`_remove_dead_writers_leftovers`)."""
    return os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(path: str) -> None:
    """Make the renames in a folder durable (POSIX; Windows cannot open a folder so)."""
    if os.name != "nt":
        _fsync(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where this
    OS, C library or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def _swap_in(new: str, path: str) -> Optional[str]:
    """Put the folder `new` at `path`; returns where the old content of `path` now is (to
    delete), or None. Linux: one atomic exchange. Elsewhere: the old folder is renamed
    aside, then the new one in: a crash between the two renames (microseconds) leaves no
    folder at `path` but the old one complete at ``.{name}.old-{pid}-*``, which the next
    save to `path` puts back before anything else (:func:`_remove_dead_writers_leftovers`)."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return None
    if _exchange(new, path):
        return new  # `new` now names the old folder
    parent, name = os.path.split(path)
    aside = os.path.join(parent, f".{name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, aside)
    os.rename(new, path)
    return aside


def _remove_dead_writers_leftovers(parent: str, name: str) -> None:
    """Delete the temporary siblings of `name` left by writers killed mid-save: only those
    whose process is gone, so a concurrent save of another process keeps its own (the pid
    is in the name). An old folder set aside by a killed fallback swap (:func:`_swap_in`)
    is put back when `name` is missing, deleted otherwise."""
    path = os.path.join(parent, name)
    for entry in sorted(os.listdir(parent)):
        for kind in ("tmp", "old"):
            prefix = f".{name}.{kind}-"
            if not entry.startswith(prefix):
                continue
            pid = entry[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            leftover = os.path.join(parent, entry)
            if kind == "old" and not os.path.lexists(path):
                os.rename(leftover, path)
            else:
                _remove(leftover)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
