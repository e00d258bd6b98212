"""Writing a directory of results all at once: complete under its final name, or not there at all."""
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
        if directory.exists():
            shutil.rmtree(directory) if directory.is_dir() else directory.unlink()
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish_permissions(directory: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
