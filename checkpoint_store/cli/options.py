"""What every command shares: ``--quiet``/``--debug``, ``-o KEY=VALUE``, exit codes.

Kept apart from the command group (:mod:`checkpoint_store.cli`) so that the
command modules import these without importing the group that registers
them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import click

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "NumberAtLeast",
    "common_options",
    "echo_info",
    "parse_storage_options",
    "quiet",
    "storage_option",
]


EXIT_OK = 0


EXIT_FAILURE = 1


EXIT_USAGE = 2


#: The reader of stdout went away (``... | head -1``): the status of a process
#: that SIGPIPE ended (128 + 13), as ``yes | head -1`` leaves it; nothing printed.
EXIT_BROKEN_PIPE = 141


def _set_meta(key: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value:
            ctx.meta[key] = True

    return callback


def common_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--quiet`` and ``--debug``, accepted before or after the command name."""
    f = click.option("-q", "--quiet", is_flag=True, expose_value=False,
                     callback=_set_meta("cs.quiet"),
                     help="No progress bars and no summary lines.")(f)
    f = click.option("--debug", is_flag=True, expose_value=False,
                     callback=_set_meta("cs.debug"),
                     help="Print the full traceback on errors.")(f)
    return f


def parse_storage_options(items: Iterable[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: "VALUE"}``, every value a string.

    The backend converts each to the type it declares for the option
    (``request_timeout=3`` -> 3.0, ``anonymous=yes`` -> True; see
    :func:`checkpoint_store.backends.base.typed_options`), the same for
    every command: the command line cannot know a value's type, and
    guessing one here would turn a numeric access key id into an int.

    Raises:
        click.BadParameter: an item without ``=`` or with an empty key. The
            message names the key but never echoes the value: a mistyped
            ``secret_access_key:...`` must not print the secret.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(
                f"{_redacted_option(item)} is not KEY=VALUE (the value is not shown; "
                "e.g. -o endpoint_url=http://127.0.0.1:9000)"
            )
        out[key.strip()] = value
    return out


def _redacted_option(item: str) -> str:
    """``item`` with everything after its key hidden: the key is what a user
    needs to find the mistake, and the value may be a credential."""
    key = item.split("=", 1)[0]
    for sep in (":", " "):  # the usual typos for '='
        key = key.split(sep, 1)[0]
    if key != item.strip() and key.isidentifier():
        return f"{key!r} followed by {len(item) - len(key)} hidden character(s)"
    return f"an option of {len(item)} character(s)"


def storage_option(*names: str, help_text: str | None = None) -> Callable[..., Any]:
    """``-o/--storage-option KEY=VALUE`` (or the option ``names``), repeatable,
    passed to the command as a dict (:func:`parse_storage_options`)."""
    names = names or ("-o", "--storage-option", "storage_options")

    def parsed(ctx: click.Context, _param: Any, values: Any) -> dict[str, Any]:
        options = parse_storage_options(values)
        # Remembered for scrub(): an engine's error may quote a credential.
        ctx.meta.setdefault("cs.storage_options", []).append(options)
        return options

    return click.option(
        *names, multiple=True, metavar="KEY=VALUE",
        callback=parsed,
        help=help_text or "Backend option for the location (endpoint, credentials ...); "
        "repeatable. Environment variables of the backend apply too.",
    )


class NumberAtLeast(click.FloatRange):
    """A float >= ``min`` that is not NaN: click's FloatRange lets NaN through
    (every comparison with it is False), and ``gc --min-age nan`` would then
    remove directories of any age."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


def scrub(text: str, ctx: click.Context | None = None) -> str:
    """``text`` with every credential hidden that the running command was given
    (``-o`` options whose key names one) or that ``text`` carries as a
    ``name=value`` pair (``?access_token=`` in a URL an engine quotes):
    :func:`~checkpoint_store.backends.uris.scrub_secrets`."""
    from checkpoint_store.backends.uris import scrub_secrets

    ctx = ctx or click.get_current_context(silent=True)
    for options in (ctx.meta.get("cs.storage_options", []) if ctx is not None else []):
        text = scrub_secrets(text, options)
    return scrub_secrets(text)


def quiet() -> bool:
    """Whether ``--quiet`` was given to the running command."""
    return bool(click.get_current_context().meta.get("cs.quiet"))


def echo_info(text: str) -> None:
    """Print a summary line to stdout unless ``--quiet``."""
    if not quiet():
        click.echo(text)
