"""The client of tests/saelens_oracle.py's `serve`: one oracle process for the whole test session, started on the
first call. Each command runs in a child the server forks after its imports (transformer-lens 3, SAELens: ~7 s), so a
command costs what it computes, not what it imports, and still runs in a process of its own."""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path

SAELENS_PYTHON = Path(os.environ.get("PROBE_SAELENS_VENV", "/tmp/saelens-venv")) / "bin" / "python"
ORACLE = Path(__file__).with_name("saelens_oracle.py")
TIMEOUT_S = 300

_server: subprocess.Popen | None = None


def _started() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([str(SAELENS_PYTHON), str(ORACLE), "serve"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, 9)  # the group: a command's child too, if one is still running
        server.wait()


def oracle(*args) -> str:
    """Run one command of saelens_oracle.py (`oracle("encode", sae_dir, ...)`); return its stdout, stripped. A failing
    command fails the caller with the end of its traceback."""
    global _server
    server = _started()
    with tempfile.TemporaryDirectory(prefix="probe-oracle-") as scratch:
        out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
        server.stdin.write(json.dumps({"args": [str(a) for a in args], "stdout": str(out), "stderr": str(err)}) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], TIMEOUT_S)
        answer = server.stdout.readline() if ready else ""
        if not answer:  # timed out or died: the next call starts a fresh server
            _stop(server)
            _server = None
            raise AssertionError(f"the oracle gave no answer to {args[0]} in {TIMEOUT_S} s"
                                 + (f": {err.read_text()[-3000:]}" if err.exists() else ""))
        rc = json.loads(answer)["rc"]
        assert rc == 0, f"oracle {args[0]} failed (exit {rc}): {err.read_text()[-3000:] if err.exists() else ''}"
        return out.read_text().strip() if out.exists() else ""
