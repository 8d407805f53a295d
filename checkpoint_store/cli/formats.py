"""``checkpoint-store export`` and ``checkpoint-store import``: a checkpoint
in another tool's format, and back (:mod:`checkpoint_store.formats`)."""

from __future__ import annotations

from typing import Any

import click

from checkpoint_store._browse.output import fmt_size
from checkpoint_store.cli.options import common_options, echo_info, storage_option
from checkpoint_store.registry import split_scheme

__all__ = ["export_cmd", "import_cmd"]


def _options_for(location: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """Backend options for a URI; None for a local path (they do not apply)."""
    return options or None if split_scheme(location) not in (None, "file") else None


@click.command("export")
@click.argument("source")
@click.argument("target")
@click.option("--format", "fmt", type=click.Choice(["hf", "torch_save", "dcp"]), default="hf",
              show_default=True, help="hf: a Hugging Face model folder (sharded safetensors "
              "and its index); torch_save: one torch.save file; dcp: a DCP directory.")
@click.option("--prefix", default=None, help="The state subtree to export ('' for all); "
              "default 'model' for hf when the state has one, else everything.")
@click.option("--name-prefix", default="", help="Prepended to each Hugging Face name.")
@click.option("--max-shard-size", type=click.IntRange(min=1), default=5 * 10**9,
              show_default=True, help="hf: most tensor bytes per file.")
@click.option("--shared", type=click.Choice(["error", "drop", "copy"]), default="error",
              show_default=True, help="hf: a tensor sharing another's storage (tied weights).")
@storage_option(help_text="Backend option for both SOURCE and TARGET; repeatable.")
@storage_option("--src-option", "src_options", help_text="Backend option for SOURCE only.")
@storage_option("--dst-option", "dst_options", help_text="Backend option for TARGET only.")
@common_options
def export_cmd(source: str, target: str, fmt: str, prefix: str | None, name_prefix: str,
               max_shard_size: int, shared: str, storage_options: dict[str, Any],
               src_options: dict[str, Any], dst_options: dict[str, Any]) -> None:
    """Write the checkpoint SOURCE (a saved state, or a folder of safetensors,
    DCP or torch.save files) as a Hugging Face folder, a torch.save file or
    a DCP directory at TARGET, on any backend. Tensors stream shard by shard,
    each checked against its CRC32C; what the format cannot hold (names
    colliding, tied weights, non-tensor values) stops it before any write.

    \b
    Examples:
      checkpoint-store export ./runs/exp/t1/checkpoint_000004 ./hf-model
      checkpoint-store export s3://b/runs/exp/t1/checkpoint_000004 ./model.pt --format torch_save
    """
    from checkpoint_store.formats import export_checkpoint

    out = export_checkpoint(
        source, target, format=fmt, prefix=prefix, name_prefix=name_prefix,  # type: ignore[arg-type]
        max_shard_size=max_shard_size, shared=shared,  # type: ignore[arg-type]
        storage_options=_options_for(source, {**storage_options, **src_options}),
        target_storage_options=_options_for(target, {**storage_options, **dst_options}))
    echo_info(f"exported {out.tensors} tensors ({fmt_size(out.nbytes)}) as {fmt} to {out.uri}: "
              f"{len(out.files)} file(s)")


@click.command("import")
@click.argument("source")
@click.argument("dest", required=False)
@click.option("--prefix", default=None, help="The state key the tensors go under (default "
              "'model' for safetensors; torch.save and DCP keep their tree).")
@storage_option(help_text="Backend option for both SOURCE and DEST; repeatable.")
@storage_option("--src-option", "src_options", help_text="Backend option for SOURCE only.")
@storage_option("--dst-option", "dst_options", help_text="Backend option for DEST only.")
@common_options
def import_cmd(source: str, dest: str | None, prefix: str | None,
               storage_options: dict[str, Any], src_options: dict[str, Any],
               dst_options: dict[str, Any]) -> None:
    """Make SOURCE (a Hugging Face folder, a torch.save file or a DCP
    directory) a committed checkpoint holding a state: at DEST, or in place
    (no tensor byte copied) when DEST is left out for a folder.

    \b
    Examples:
      checkpoint-store import ./Llama-3.2-1B
      checkpoint-store import ./model.pt s3://b/imports/checkpoint_000000
    """
    from checkpoint_store.formats import import_checkpoint

    ck = import_checkpoint(
        source, dest, prefix=prefix,
        storage_options=_options_for(source, {**storage_options, **src_options}),
        dest_storage_options=(_options_for(dest, {**storage_options, **dst_options})
                              if dest else None))
    echo_info(f"committed {ck.uri}")
