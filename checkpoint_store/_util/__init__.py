"""Storage calls and process facts every layer above the backends uses.

``fs`` (filesystem calls, each retried), ``retry`` (the retry policy),
``clock`` (the storage's clock and the one seam for the local one),
``liveness`` (is a writer process still alive, its incarnation token),
``ids`` (writer and run identifiers).
"""
