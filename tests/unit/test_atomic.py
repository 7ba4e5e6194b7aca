"""write_atomic: a result written through a temporary file lands as a plain write would leave it."""

import os
import stat

from redline.atomic import write_atomic


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
