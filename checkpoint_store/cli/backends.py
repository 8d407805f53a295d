"""The ``backends`` command: which URI schemes are installed, and how to add the rest.

The answer is the registry's (:func:`checkpoint_store.registry.available_backends`
and :data:`~checkpoint_store.registry.KNOWN_PLUGINS`).
"""

from __future__ import annotations

from typing import Any

import click

from checkpoint_store._browse.output import print_json, table
from checkpoint_store.cli.options import common_options

__all__ = ["backends_cmd"]


@click.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@common_options
def backends_cmd(as_json: bool) -> None:
    """List the registered URI schemes and the distribution providing each.

    Known cloud schemes whose plugin is not installed are listed with the
    pip command that adds them.

    \b
    Examples:
      checkpoint-store backends
      checkpoint-store backends --json
    """
    from checkpoint_store.registry import KNOWN_PLUGINS, available_backends

    rows: list[dict[str, Any]] = [{"scheme": s, "provided_by": src, "installed": True}
                                  for s, src in available_backends().items()]
    have = {r["scheme"] for r in rows}
    for scheme, dist in sorted(KNOWN_PLUGINS.items()):
        if scheme not in have:
            rows.append({"scheme": scheme, "provided_by": dist, "installed": False})
    if as_json:
        print_json(rows)
        return
    table(["SCHEME", "PROVIDED BY", "STATUS"],
          [[f"{r['scheme']}://", str(r["provided_by"]),
            "installed" if r["installed"] else f"not installed: pip install {r['provided_by']}"]
           for r in rows])
