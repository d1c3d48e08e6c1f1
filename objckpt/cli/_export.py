"""``objckpt export URL DEST --format safetensors``: a checkpoint written in another library's format."""

from __future__ import annotations

import argparse
import dataclasses

from objckpt.cli._output import dump
from objckpt.cli._stores import UsageError, options_from_args
from objckpt.options import Options
from objckpt.progress import human_bytes

#: The formats ``objckpt export`` writes.
FORMATS = ("safetensors",)


def export(args: argparse.Namespace, options: Options) -> int:
    """Export the checkpoint ``args.src`` to ``args.dst`` (:func:`objckpt.safetensors.export_safetensors`)."""
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format}: objckpt export writes {', '.join(FORMATS)}")
    from objckpt.safetensors.export import DEFAULT_MAX_SHARD_BYTES, export_safetensors

    stats = export_safetensors(
        args.src,
        args.dst,
        max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES,
        dtype=args.dtype,
        subtree=args.subtree,
        src_storage_options=options_from_args(args, args.src, "src"),
        dst_storage_options=options_from_args(args, args.dst, "dst"),
        options=options,
        overwrite=args.overwrite,
        progress=args.progress,
        client=args.client,
    )
    if args.json:
        dump(dataclasses.asdict(stats))
    else:
        print(
            f"exported {args.src} to {args.dst}: {len(stats.files)} file(s), {stats.tensors} tensors,"
            f" {human_bytes(stats.tensor_bytes)} in {stats.seconds:.2f} s"
        )
    return 0
