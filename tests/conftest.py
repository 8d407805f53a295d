"""Shared fixtures for checkpoint-store's own tests.

Server fixtures (S3, Azure, GCS) come from the shipped pytest plugin,
``checkpoint_store.testing.plugin``.
"""

from __future__ import annotations

import os

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
