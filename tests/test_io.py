"""probe.io: results appear complete under their final name or not at all, never replace an existing
one unless asked, and get ordinary (umask) permissions, not mkstemp's private ones."""
from __future__ import annotations

import os
import stat

import pytest

from probe.io import atomic_directory, atomic_file


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def siblings(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_file_appears_whole_with_ordinary_permissions(tmp_path, umask_022):
    target = tmp_path / "result.csv"
    with atomic_file(target) as tmp:
        tmp.write_text("a,b\n")
        assert not target.exists()  # nothing under the final name while it is written
    assert target.read_text() == "a,b\n"
    assert mode(target) == 0o644
    assert siblings(tmp_path) == ["result.csv"]


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "result.csv"
    target.write_text("earlier")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(target, overwrite=True) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "earlier"
    assert siblings(tmp_path) == ["result.csv"]


def test_an_existing_file_is_replaced_only_when_asked(tmp_path):
    target = tmp_path / "result.csv"
    target.write_text("earlier")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        with atomic_file(target):
            pass
    with atomic_file(target, overwrite=True) as tmp:
        tmp.write_text("later")
    assert target.read_text() == "later"


def test_a_file_that_appears_while_writing_is_kept(tmp_path):
    target = tmp_path / "result.csv"
    with pytest.raises(FileExistsError, match="created by something else"):
        with atomic_file(target) as tmp:
            tmp.write_text("ours")
            target.write_text("theirs")
    assert target.read_text() == "theirs"
    assert siblings(tmp_path) == ["result.csv"]


def test_a_directory_gets_ordinary_permissions(tmp_path, umask_022):
    target = tmp_path / "lens"
    with atomic_directory(target) as tmp:
        (tmp / "config.json").write_text("{}")
    assert mode(target) == 0o755 and mode(target / "config.json") == 0o644


def test_library_writers_publish_ordinary_files(tiny_model, tmp_path, umask_022):
    """memory_report and TopTriggers.save wrote through mkstemp, whose files are private (0600)."""
    from probe.analyses import memory_report, top_triggers

    triggers = top_triggers(tiny_model, ["To be, or not to be, that is the question."], k=2, progress=False)
    saved = triggers.save(tmp_path / "triggers.safetensors")
    memory_report(tiny_model, triggers, tmp_path / "cards.html", max_cards=2)
    assert mode(saved) == 0o644 and mode(tmp_path / "cards.html") == 0o644
    with pytest.raises(FileExistsError):
        memory_report(tiny_model, triggers, tmp_path / "cards.html", max_cards=2)


@pytest.mark.parametrize("writer", [atomic_file, atomic_directory])
def test_an_oserror_while_writing_names_the_final_file(tmp_path, writer):
    """ENOSPC and EIO carry no file name; the temporary's would mean nothing: the final name is given."""
    import errno

    target = tmp_path / "result"
    with pytest.raises(OSError, match=rf"No space left on device \(writing {target}\)") as caught:
        with writer(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.errno == errno.ENOSPC
    assert siblings(tmp_path) == []
    with pytest.raises(PermissionError, match="/elsewhere/x"):  # an error naming another file is left as it is
        with writer(target):
            raise PermissionError(errno.EACCES, "Permission denied", "/elsewhere/x")
