"""How a directory becomes a committed checkpoint, and stops being one.

``commit`` (:func:`commit_checkpoint` and :func:`delete_checkpoint_dir`, the
two calls most callers need), ``protocols`` (rename commit and marker-last
commit, chosen from a backend's capabilities), ``refusals`` (what a commit
must not write over), ``claims`` (who may write a destination),
``removal`` (deleting in an order a reader never misreads), ``leftovers``
(staging and tombstones a crashed writer left), ``pointer`` (the latest
checkpoint's pointer file), ``nesting`` (a checkpoint inside another's
directory refused), ``download_target`` (the local side of a download:
helper directories, completion marker, crash recovery), ``rankparts`` (each
rank's part of one checkpoint and its marker, and the commit from the
markers: a multi-rank session and Ray Train share it).
"""
