"""``python -m checkpoint_store.testing.crash zygote [module ...]``: the forking helper."""

import sys

from checkpoint_store.testing.crash._child import zygote_main

if sys.argv[1:2] == ["zygote"]:
    zygote_main(sys.argv[2:])
else:
    raise SystemExit("usage: python -m checkpoint_store.testing.crash zygote")
