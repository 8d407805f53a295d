"""Moving bytes between two filesystems, checksummed in flight.

``trees`` (copy a tree up, download one back; the public face is
:mod:`checkpoint_store.transfer`), ``plan`` (which route, which parts, the
run), ``tasks`` (the per-file and per-part work, :class:`TransferTasks`),
``remote`` (multipart uploads, Azure blocks, byte ranges, server-side copy),
``localcopy`` (local-disk reads and writes, kernel copies, flushes),
``budget`` (the memory bound on bytes in flight), ``crc32c`` (checksums and
their combination).
"""
