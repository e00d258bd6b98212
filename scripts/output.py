"""A command's output directory: owned by one run, filled in private, published whole at the end.

- **One run per directory.** The run holds a lock, `.probe-lock` inside the directory (an `flock`, released
  by the kernel when the process dies however it dies). A second run on the same `--out` is refused, naming
  the first one's pid; a lock left by a killed run is recognised (nobody holds it; its pid is gone), said so,
  and its temporary files are removed.
- **Nothing half old, half new.** Every file is written into a staging folder inside the directory
  (`.probe-staging-*`, hidden, removed on any failure, Ctrl-C or SIGTERM) and moved into place only when the
  command succeeds (signals held off while the files move). A failed run leaves the directory as it was.
- **No stale results beside new ones.** Each run records what it wrote in `.probe-run.json`; a later `--force`
  run removes the earlier run's files it did not write again (saying so) and names any other files it kept.
- **One plotly.js per directory.** Figures reference a shared `plotly.min.js` beside them (`--plotly directory`,
  the default), or embed it (`inline`), or load it from the CDN (`cdn`); a command that writes two or more
  pages also gets an `index.html` linking them all.
"""
from __future__ import annotations

import datetime
import html
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

LOCK, STAGING, MANIFEST = ".probe-lock", ".probe-staging-", ".probe-run.json"
PLOTLY_MODES = ("directory", "inline", "cdn")
PLOTLY_FILE = "plotly.min.js"


class OutputError(Exception):
    """Why a directory cannot be used; scripts.common turns it into a CommandError."""


def _ours(name: str) -> bool:
    """Files the machinery keeps in an output directory, invisible to the emptiness check."""
    return name in (LOCK, MANIFEST) or name.startswith(STAGING)


class Settings:
    """What run_command knows from the flags: whether to log, and how figures get plotly.js."""
    quiet: bool = False
    plotly: str = "directory"


SETTINGS = Settings()
OPEN: list["Output"] = []  # outputs of the command now running, published or aborted by run_command


def _log(message: str) -> None:
    if not SETTINGS.quiet:
        print(message, file=sys.stderr)


class Output:
    """See the module docstring. `path(name)` is where to write `name` while the run lasts (the staging
    folder), `final(name)` where it will be once published."""

    def __init__(self, directory: Path, force: bool, *, created: bool = False):
        self.directory = Path(directory)
        self.force, self.created = force, created
        self.written: list[Path] = []  # final paths, in the order written
        self.removed: list[Path] = []
        self.discards: list[str] = []
        self.kept_earlier: set[str] = set()
        self.published = self.aborted = False
        self.staging: Optional[Path] = None
        if self.directory.exists() and not self.directory.is_dir():
            raise OutputError(f"--out {self.directory} is a file; give a directory")
        try:
            existed = self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            self.created = self.created or not existed
            self._lock = _Lock(self.directory / LOCK)
            stale = self._lock.acquire()
        except OSError as err:
            raise OutputError(f"--out {self.directory} cannot be written: {err.strerror or err}") from err
        try:
            if stale:
                self._clean_after(stale)
            parts = sorted(p for p in self.directory.iterdir() if p.name.startswith(".") and p.name.endswith(".part"))
            others = [p for p in self.directory.iterdir() if not _ours(p.name)]
            if others and not force:
                only = (f" (it holds only {', '.join(p.name for p in parts)}: a temporary file an interrupted run left; "
                        "--force removes it)") if len(parts) == len(others) else ""
                raise OutputError(f"--out {self.directory} is not empty{only}; choose another directory or pass --force")
            for part in parts:  # atomic_file's temporaries (.NAME.XXXX.part) of a run killed while writing
                part.unlink()
                _log(f"removed {part}: a temporary file an interrupted run left")
            try:
                self.staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=self.directory))
            except OSError as err:
                raise OutputError(f"--out {self.directory} cannot be written: {err.strerror or err}") from err
            self._lock.record(staging=self.staging.name)
        except BaseException:
            self._lock.release()
            raise
        OPEN.append(self)

    # ---- writing ------------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.staging / name if not (self.published or self.aborted) else self.directory / name

    def final(self, name: str) -> Path:
        return self.directory / name

    def _landed(self, name: str) -> Path:
        final = self.final(name)
        if final not in self.written:
            self.written.append(final)
        _log(f"wrote {final}")
        return final

    def write_bytes(self, name: str, data: bytes) -> Path:
        target = self.path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)  # private until published, and removed whole on failure: no temporary name needed
        return self._landed(name)

    def write_text(self, name: str, text: str) -> Path:
        return self.write_bytes(name, text.encode("utf-8"))

    def write_csv(self, name: str, frame) -> Path:
        return self.write_text(name, frame.to_csv(index=False))

    def write_json(self, name: str, value) -> Path:
        return self.write_text(name, json.dumps(value, indent=2, default=str) + "\n")

    def write_figure(self, name: str, figure) -> Path:
        """An HTML page of a plotly figure, with plotly.js as --plotly says (default: one shared file beside it)."""
        mode = SETTINGS.plotly
        if mode == "directory" and not self.path(PLOTLY_FILE).exists():
            from plotly.offline import get_plotlyjs

            self.path(PLOTLY_FILE).write_text(get_plotlyjs(), encoding="utf-8")
            self.written.append(self.final(PLOTLY_FILE))
        include = {"directory": PLOTLY_FILE, "inline": True, "cdn": "cdn"}[mode]
        return self.write_text(name, figure.to_html(full_html=True, include_plotlyjs=include))

    def discard(self, name: str) -> Optional[Path]:
        """Remove, when this run is published, a file this command writes under another name in other runs (a
        partial result that a complete one supersedes); returns it if it is there."""
        path = self.final(name)
        if path in self.written or not path.is_file():
            return None
        self.discards.append(name)
        return path

    def keep(self, *names: str) -> None:
        """Leave these files of an earlier run in place at publish (a partial result does not supersede them)."""
        self.kept_earlier.update(names)

    # ---- the end of the run ------------------------------------------------------------------------------
    def report(self, args=None) -> None:
        """Publish the run's files (see the module docstring) and say where they are, even with --quiet."""
        if self.published or self.aborted:
            return
        pages = [p.name for p in self.written if p.suffix == ".html"]
        if len(pages) >= 2 and self.final("index.html") not in self.written:
            self.write_text("index.html", _index_page(self.directory.name, pages, [p.name for p in self.written]))
        new = {str(p.relative_to(self.staging)) for p in self.staging.rglob("*") if p.is_file()}
        earlier = _manifest(self.directory / MANIFEST)
        with _signals_held():
            for name in sorted(new):
                (self.directory / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.staging / name, self.directory / name)
            for name in sorted((set(earlier) - self.kept_earlier) | set(self.discards)):
                path = self.directory / name
                if name not in new and path.is_file():
                    path.unlink()
                    self.removed.append(path)
            still = {n for n in self.kept_earlier & set(earlier) if (self.directory / n).is_file()}
            record = {"written": sorted(new | still), "finished": datetime.datetime.now().isoformat(timespec="seconds")}
            (self.staging / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
            os.replace(self.staging / MANIFEST, self.directory / MANIFEST)
            shutil.rmtree(self.staging, ignore_errors=True)
            self.published = True
        self._lock.release()
        OPEN.remove(self)
        for path in self.removed:
            _log(f"removed {path}: an earlier run wrote it and this one did not (it would be stale beside the new files)")
        kept = sorted(p.name for p in self.directory.iterdir() if not _ours(p.name) and p.name not in new)
        if kept:
            _log(f"note: kept {len(kept)} file(s) in {self.directory} that this run did not write: "
                 f"{', '.join(kept[:8])}{' ...' if len(kept) > 8 else ''}")
        print(f"results in {self.directory}", file=sys.stderr)  # shown with --quiet too: where the output went

    def abort(self, why: str) -> None:
        """The run failed or was stopped: its files are dropped, the directory is left as it was."""
        if self.published or self.aborted:
            return
        self.aborted = True
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._lock.release()
        if self in OPEN:
            OPEN.remove(self)
        if self.created and self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()
        if self.written:
            print(f"{why}: none of the files above was kept; {self.directory} is as it was before this run",
                  file=sys.stderr)

    def _clean_after(self, stale: dict) -> None:
        """The temporary files of a run that was killed (its lock was left behind, but nobody holds it)."""
        staging = stale.get("staging")
        if isinstance(staging, str) and staging.startswith(STAGING) and "/" not in staging:
            shutil.rmtree(self.directory / staging, ignore_errors=True)
        for path in self.directory.glob(STAGING + "*"):  # any other left by runs killed before they recorded it
            shutil.rmtree(path, ignore_errors=True)
        who = f"pid {stale.get('pid')}" + (f", started {stale['started']}" if stale.get("started") else "")
        _log(f"note: an earlier run on {self.directory} ({who}) was killed before it finished; its lock and "
             "temporary files are removed, its unfinished results were never published")


def fresh_directory(base: Path) -> Path:
    """A new directory `base`-YYYYmmdd-HHMMSS (then -2, -3, ... if taken): made here, so two runs started in the
    same second get two directories."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = base.parent / f"{base.name}-{stamp}{'' if n == 1 else f'-{n}'}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise OutputError(f"could not make a fresh directory beside {base}; pass --out")


def _manifest(path: Path) -> list[str]:
    """The files an earlier run recorded (names inside the directory only; anything odd is ignored)."""
    try:
        names = json.loads(path.read_text()).get("written", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and n and not Path(n).is_absolute() and ".." not in Path(n).parts
            and not _ours(Path(n).parts[0])]


def _index_page(title: str, pages: list[str], files: list[str]) -> str:
    link = lambda name: f'<li><a href="{html.escape(name, quote=True)}">{html.escape(name)}</a></li>'
    others = [f for f in files if f not in pages and f != "index.html" and f != PLOTLY_FILE]
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>" + html.escape(title) + "</title></head>"
            "<body style='font-family:sans-serif'><h1>" + html.escape(title) + "</h1><h2>Pages</h2><ul>"
            + "".join(link(p) for p in pages) + "</ul>"
            + (("<h2>Data</h2><ul>" + "".join(link(f) for f in others) + "</ul>") if others else "")
            + "</body></html>\n")


@contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the files have moved (they arrive right after), so a publish is never cut."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Lock:
    """An exclusive lock on a file: flock where there is one (released by the kernel when its process dies),
    else the file's existence with a pid check. The file says who holds it."""

    def __init__(self, path: Path):
        self.path, self.fd, self.info = path, None, {}

    def acquire(self) -> dict:
        """Take the lock; returns the record a killed run left ({} if none). Raises OutputError if held."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the file itself, with its pid checked
            return self._acquire_by_pid()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_record(fd)
                os.close(fd)
                raise OutputError(self._in_use(holder)) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its holder unlinked while we waited for it
                break
            os.close(fd)
        self.fd = fd
        stale = _read_record(fd)
        self.record()
        return stale

    def _acquire_by_pid(self) -> dict:
        stale = {}
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            stale = json.loads(self.path.read_text() or "{}")
            if _alive(stale.get("pid")):
                raise OutputError(self._in_use(stale)) from None
            self.path.unlink()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.fd = fd
        self.record()
        return stale

    def _in_use(self, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')}" + (f", started {holder['started']}" if holder.get("started") else "")
        return (f"--out {self.path.parent} is in use by another probe run ({who}); wait for it to finish, or "
                "choose another --out")

    def record(self, **extra) -> None:
        self.info = {"pid": os.getpid(), "started": self.info.get("started") or
                     datetime.datetime.now().isoformat(timespec="seconds"), **self.info, **extra}
        data = json.dumps(self.info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiter then sees a fresh file, not this one
        finally:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _read_record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data else {}
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
