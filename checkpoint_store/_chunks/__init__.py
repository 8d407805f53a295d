"""Content-addressed chunks of checkpoint files: stored once, freed by retention.

A file of a checkpoint may live outside its directory as chunks in the
experiment's chunk store (``<experiment>/.cs_chunks/``): its manifest entry
lists them, the marker still commits last (docs/format.md, "Chunks").
"""
