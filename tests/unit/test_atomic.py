"""write_atomic: a result written through a temporary file lands as a plain write would leave it."""

import os
import stat
import threading

from redline.atomic import check_writable, write_atomic


def test_a_written_file_has_the_mode_the_umask_gives_not_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "report.html"
        write_atomic(path, lambda tmp: tmp.write_text("<p>x</p>"))
    finally:
        os.umask(old)
    assert path.read_text() == "<p>x</p>"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # others can read a report, as with open(path, "w")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left beside it


def test_a_named_pipe_is_written_into_not_renamed_over(tmp_path):
    """A rename would put a regular file in place of the pipe (or, as root, of /dev/null for everyone)."""
    fifo = tmp_path / "results"
    os.mkfifo(fifo)
    check_writable(fifo)  # asks, without opening it: that would wait for a reader
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomic(fifo, lambda target: target.write_text("<html>report</html>"))
    reader.join(timeout=10)
    assert received == [b"<html>report</html>"]
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_file_written_again_keeps_its_mode_as_a_plain_write_does(tmp_path):
    """Before, a file the user had made private (0600) came back readable by everyone (0644 under umask 022)."""
    old = os.umask(0o022)
    try:
        private, shared = tmp_path / "model.safetensors", tmp_path / "run.sh"
        private.write_text("earlier")
        private.chmod(0o600)
        shared.write_text("earlier")
        shared.chmod(0o755)
        write_atomic(private, lambda tmp: tmp.write_text("later"))
        write_atomic(shared, lambda tmp: tmp.write_text("later"))
    finally:
        os.umask(old)
    assert private.read_text() == "later" and stat.S_IMODE(private.stat().st_mode) == 0o600
    assert shared.read_text() == "later" and stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_a_link_is_written_through_to_its_file_not_replaced(tmp_path):
    """Before, the rename put a regular file in place of the link, and the file it pointed at kept the old data."""
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "summary.json"
    target.write_text("earlier")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    check_writable(link)
    write_atomic(link, lambda tmp: tmp.write_text("later"))
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text() == "later"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["latest.json", "runs", "summary.json"]  # nothing left over


def test_temporary_files_a_killed_write_left_are_removed_by_the_next_write_of_that_file(tmp_path):
    """SIGKILL (or the OOM killer) mid-write ran no cleanup: its hidden temporary file, as large as the output,
    stayed for good beside it."""
    import subprocess
    import sys

    from redline.atomic import _OWNER

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # fmt: skip
    killed = tmp_path / f".out.npy.{_OWNER}-{gone}-0a1b2c3d.tmp"
    remote = tmp_path / f".out.npy.elsewhere-{gone}-0a1b2c3d.tmp"  # another machine's, on shared storage
    ours = tmp_path / f".out.npy.{_OWNER}-{os.getpid()}-0a1b2c3d.tmp"  # this process's own write, in progress
    for path in (killed, remote, ours):
        path.write_bytes(b"half")
    write_atomic(tmp_path / "out.npy", lambda tmp: tmp.write_bytes(b"whole"))
    assert (tmp_path / "out.npy").read_bytes() == b"whole"
    assert not killed.exists() and remote.exists() and ours.exists()
