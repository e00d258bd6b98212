"""Writing results all at once, a file or a directory: complete under its final name, or not there
at all, never replacing an existing one unless asked, with the usual (umask) permissions."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union


@contextmanager
def atomic_directory(directory: Union[str, Path], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it is renamed to `directory`.

    An existing `directory` is refused unless `overwrite`, and is only replaced once the new one is
    complete; on any failure the temporary directory is removed and nothing else is touched. Files
    get the usual umask-based permissions (mkdtemp's are private).
    """
    directory = Path(directory).expanduser()
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} already exists; choose a new directory or pass overwrite=True")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        yield tmp
        _publish_permissions(tmp)
        if directory.exists() and not overwrite:
            # it appeared while we were writing (another run, same name): that one is kept
            raise FileExistsError(f"{directory} was created by something else while this was written; nothing replaced")
        _replace(tmp, directory)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _naming(err, directory, tmp) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: Union[str, Path], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path to write; on success it is renamed to `path`.

    An existing `path` is refused unless `overwrite` (checked before and again after writing, so a
    file that appeared meanwhile is kept); on any failure the temporary file is removed.
    """
    path = Path(path).expanduser()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it or choose another path")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o666 & ~umask())  # mkstemp's files are private; results are ordinary files
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} was created by something else while this was written; nothing replaced")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _naming(err, path, tmp) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _naming(err: OSError, final: Path, tmp: Path) -> OSError:
    """`err` saying which result it was writing: ENOSPC and EIO name no file, and a temporary's name means
    nothing to the user. Errors that already name another file (or are our own refusals) pass unchanged."""
    if isinstance(err, FileExistsError) or (err.filename is not None and not str(err.filename).startswith(str(tmp))):
        return err
    return OSError(err.errno, f"{err.strerror or err} (writing {final})")


def umask() -> int:
    """The process's umask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(new: Path, directory: Path) -> None:
    """Put `new` at `directory`; an old one is moved aside first and deleted only once `new` is in place."""
    if not directory.exists():
        os.replace(new, directory)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
    old = aside / directory.name
    os.replace(directory, old)
    try:
        os.replace(new, directory)
    except BaseException:
        os.replace(old, directory)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _publish_permissions(directory: Path) -> None:
    mask = umask()
    directory.chmod(0o777 & ~mask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
