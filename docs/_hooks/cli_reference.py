"""mkdocs hook: expand ``<!-- cli-reference -->`` into the CLI's own --help texts.

The reference is generated from the click commands at build time, so it
cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- cli-reference -->"


def _help_text(name: str | None) -> str:
    import click

    from checkpoint_store.cli import main

    command: click.Command = main if name is None else main.commands[name]
    settings = {"help_option_names": ["-h", "--help"], "max_content_width": 100,
                "terminal_width": 100}
    parent = click.Context(main, info_name="checkpoint-store", **settings)
    ctx = click.Context(command, info_name=name, parent=parent, **settings) if name else parent
    return command.get_help(ctx)


def render() -> str:
    """The Markdown for every command: a heading and its --help output."""
    from checkpoint_store.cli import main

    parts = ["### checkpoint-store", "", "```text", _help_text(None), "```", ""]
    for name in main.commands:
        parts += [f"### checkpoint-store {name}", "", "```text", _help_text(name), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
