"""A ``pyarrow.fs.FileSystemHandler`` that forwards every call to another filesystem.

The handlers that wrap a filesystem (the command line's counting reads, the
test kit's fault injection, the object-store plugins' marker-free deletes)
derive from :class:`ForwardingHandler` and override only the calls they
change. Wrap one in ``pyarrow.fs.PyFileSystem(handler)`` to use it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["ForwardingHandler"]


class ForwardingHandler(pafs.FileSystemHandler):
    """Every ``FileSystemHandler`` call goes to ``inner`` unchanged.

    Args:
        inner: the wrapped pyarrow filesystem.

    Two handlers are equal (pyarrow compares them to decide whether two
    ``PyFileSystem`` are the same) when they are of the same class and their
    inner filesystems are equal; a subclass with state of its own overrides
    ``__eq__``. ``type_name`` is the inner one's unless ``get_type_name`` is
    overridden.
    """

    def __init__(self, inner: pafs.FileSystem):
        self.inner = inner

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ForwardingHandler)
            and type(other) is type(self)
            and self.inner.equals(other.inner)
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(type(self))

    def get_type_name(self) -> str:
        return self.inner.type_name

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return self.inner.open_append_stream(path, metadata=metadata)
