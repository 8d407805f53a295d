"""Content-addressed chunks: a checkpoint's large files stored as pieces named
by their content, each stored once per experiment and referenced from the
manifests of the checkpoints that hold it.

``codec`` (the chunk object's format, its name, and the lossless codecs that
encode its bytes), ``planes`` (the byte planes of ``planes-zstd``).
"""
