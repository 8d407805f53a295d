"""How a directory becomes a committed checkpoint, and stops being one.

``protocols`` (rename commit and marker-last commit, chosen from a
backend's capabilities), ``claims`` (who may write a destination),
``removal`` (deleting in an order a reader never misreads), ``leftovers``
(staging and tombstones a crashed writer left), ``pointer`` (the latest
checkpoint's pointer file), ``nesting`` (a checkpoint inside another's
directory refused).
"""
