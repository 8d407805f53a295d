"""Importing the core pulls in no framework: integrations load on demand."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_no_framework():
    code = textwrap.dedent("""
        import sys
        import checkpoint_store, checkpoint_store.session, checkpoint_store.cli
        import checkpoint_store.integrations
        loaded = sorted(m for m in ("torch", "transformers", "accelerate", "lightning",
                                    "pytorch_lightning", "optuna") if m in sys.modules)
        print(loaded)
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
