"""A trial's reported results on storage: ``result.json`` and its segments.

``writer`` (the buffered :class:`ResultLog` of one trial, flushed in
segments and at exit) and ``reader`` (listing, parsing and assembling the
segments back into rows).
"""
