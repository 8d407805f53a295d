"""What checkpoint-store writes beside the user's data, as values: no I/O.

``layout`` builds and parses every on-storage name (staging, tombstone, claim,
rank marker, lease, lock, result segments); ``jsonrules`` is the one JSON
dialect of every metadata file (strict parsing, finite numbers).
"""
