"""A report with ``staging="move"`` that raised before its commit was queued
takes its staged copy back (session/_uploads.py ``Staged.take_back``): the
files go back into the reported directory. Where some cannot go back, the
staged copy holds the only copy of a user's files: it stays, and no later
process's sweep of the staging root removes it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from checkpoint_store.session._uploads import stage
from checkpoint_store.state._staging_dir import sweep_staging_root


def _tree(d: str) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, d)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = f.read()
            elif not os.listdir(p):
                out[rel + "/"] = "empty"
    return out


def _checkpoint(d: str) -> None:
    os.makedirs(os.path.join(d, "opt", "shards"))
    os.makedirs(os.path.join(d, "empty"))
    with open(os.path.join(d, "model.pt"), "wb") as f:
        f.write(b"m" * 4096)
    with open(os.path.join(d, "opt", "shards", "0.pt"), "wb") as f:
        f.write(b"o" * 100)
    os.symlink("model.pt", os.path.join(d, "latest.pt"))


def test_moved_files_go_back_whole_nested_empty_dirs_and_links(tmp_path):
    src, root = str(tmp_path / "ckpt"), str(tmp_path / "staging")
    os.makedirs(root)
    _checkpoint(src)
    before = _tree(src)
    staged = stage(src, "move", root=root)
    assert _tree(src) == {}
    os.rmdir(src)  # the loop removed the emptied directory meanwhile
    staged.take_back()
    assert _tree(src) == before
    assert os.listdir(root) == []


def test_files_that_cannot_go_back_outlive_a_later_sweep(tmp_path):
    """The reported directory became a file while the report ran: no moved
    file can go back. They stayed in a scratch directory named for this
    process, which the next process's sweep of the staging root removed
    once this one had exited: the only copy of the user's checkpoint."""
    src, root = str(tmp_path / "ckpt"), str(tmp_path / "staging")
    os.makedirs(root)
    _checkpoint(src)
    before = _tree(src)
    script = textwrap.dedent(f"""
        import os
        from checkpoint_store.session._uploads import stage
        staged = stage({src!r}, "move", root={root!r})
        os.rmdir({src!r})
        open({src!r}, "w").close()
        staged.take_back()
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    sweep_staging_root(root)  # a later process: the maker has exited
    kept = [os.path.join(root, n) for n in os.listdir(root)]
    assert [_tree(k) for k in kept] == [before]
