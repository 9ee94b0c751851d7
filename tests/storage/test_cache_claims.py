"""Claims of cache entries written in place (``.loading-<key>``): who holds one, and what
is left when its holder died."""

from __future__ import annotations

import os
import subprocess
import sys

from trainer.storage import cache


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_claim_appears_with_its_owner_and_only_once(tmp_path):
    assert cache._claim(tmp_path, "abc")
    claim = cache._claim_path(tmp_path, "abc")
    assert claim.read_text() == str(os.getpid())  # never an empty claim, even for a moment
    assert not cache._claim(tmp_path, "abc")  # held: a second claim is refused
    assert sorted(p.name for p in tmp_path.iterdir()) == [claim.name]  # no temporaries left


def test_a_dead_holders_entry_and_claim_are_removed_a_live_ones_kept(tmp_path):
    for key, pid in (("dead", _dead_pid()), ("live", os.getpid())):
        (tmp_path / key).mkdir()
        (tmp_path / key / "partial").write_bytes(b"half a download")
        cache._claim_path(tmp_path, key).write_text(str(pid))
    cache._remove_abandoned(tmp_path)
    assert not (tmp_path / "dead").exists()
    assert not cache._claim_path(tmp_path, "dead").exists()
    assert (tmp_path / "live" / "partial").is_file()
    assert cache._claim_path(tmp_path, "live").is_file()
