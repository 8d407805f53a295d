"""Read-only views of a store that the command line and the web page share.

``locations`` (what a path or URI points at: root, experiment, trial,
checkpoint; the trial's checkpoints as recorded or listed), ``output``
(sizes, times, values, tables and JSON as printed), ``spark`` (a trial's
metric history as a sparkline), ``status`` (a trial's status, preempted
included, and its preemption checkpoints). Nothing here writes to storage.
"""
