"""A file given where a directory of checkpoints belongs is a usage error
(exit 2) that says so, on every command and backend.

`ls`, `best`, `verify`, `prune`, `gc` and `cp` of a file on a local disk
exited 1 with "Cannot list directory ... Not a directory. Check the path,
bucket and permissions (credentials, IAM policy ...)" and a hint at the
credentials, while `show` and `download` said "is a file".
"""

from __future__ import annotations

import posixpath

import pytest
from cli_helpers import invoke, make_trial, put

COMMANDS = [
    ["ls"], ["best", "--metric", "loss"], ["verify"], ["prune", "--keep", "1"],
    ["gc", "--dry-run"], ["show"],
]


def _run(store, args, where, _tmp_path):
    return invoke([args[0], where, *args[1:], *store.opt_args()])


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_a_file_where_a_trial_belongs(every_store, tmp_path, args):
    ctx = make_trial(every_store, tmp_path, [0.5, 0.2])
    put(ctx, posixpath.join(posixpath.dirname(ctx.trial_path), "afile"), b"notes")
    res = _run(every_store, args, every_store.join("exp", "afile"), tmp_path)
    assert res.exit_code == 2, res.output
    assert "is a file" in res.stderr and "credentials" not in res.stderr, res.stderr


def test_a_trial_file_given_to_ls_cp_and_download(every_store, tmp_path):
    """The same kind, on a file of ours inside a trial."""
    make_trial(every_store, tmp_path, [0.5])
    ctx = every_store.ctx()
    put(ctx, posixpath.join(ctx.trial_path, "result.json"), b"{}\n")
    where = every_store.join("exp", "t1", "result.json")
    opts = every_store.opt_args()
    for args in (["ls", where], ["cp", where, str(tmp_path / "copy")],
                 ["download", where, str(tmp_path / "dl")], ["verify", where]):
        res = invoke([*args, *opts])
        assert res.exit_code == 2, (args, res.output)
        assert "is a file" in res.stderr and "credentials" not in res.stderr, res.stderr
    assert not (tmp_path / "copy").exists() and not (tmp_path / "dl").exists()
