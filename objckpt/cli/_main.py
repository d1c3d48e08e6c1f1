"""Argument parsing, logging and error reporting for ``objckpt``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from objckpt.cli._stores import UsageError, add_store_flags, parse_size, redact, secret_values
from objckpt.storage.urls import scrub

_EPILOG = """\
Store options come from flags and from the usual environment: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL(_S3), AWS_DEFAULT_REGION,
GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST.

Exit status: 0 success; 1 failure (one line on stderr) or problems found by verify;
2 bad command line; 130 interrupted.  See docs/CLI.md.
"""


def _common(
    parser: argparse.ArgumentParser, *, json_help: str = "machine-readable output on stdout", top: bool = False
) -> None:
    """The output flags every command takes, before the command (``top``) or after it.

    After the command they default to ``SUPPRESS``: a subcommand's defaults would
    otherwise overwrite what was given before it (``objckpt --debug ls URL``).
    """
    group = parser.add_argument_group("output (before or after the command)" if top else "output")

    def flag(*names: str, **kw: Any) -> None:
        if not top:
            kw["default"] = argparse.SUPPRESS
        group.add_argument(*names, **kw)

    flag("--json", action="store_true", help=json_help)
    flag("--no-progress", dest="progress", action="store_false", help="never draw a progress bar")
    flag("-v", "--verbose", action="store_true", help="log what objckpt does (INFO)")
    flag("--debug", action="store_true", help="DEBUG logs, and a traceback on error")


def _tuning(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tuning")
    group.add_argument("--concurrency", type=int, metavar="N", help="requests in flight per store (default 32)")
    group.add_argument(
        "--memory-budget", type=parse_size, metavar="SIZE", help="bytes of blobs held at once, e.g. 2GiB"
    )
    group = parser.add_argument_group("on Dask (pip install 'objckpt[dask]')")
    group.add_argument("--workers", type=int, metavar="N", help="run as tasks on N local worker processes")
    group.add_argument("--scheduler", metavar="ADDRESS", help="run as tasks on the Dask cluster at ADDRESS")
    group.add_argument("--memory-per-worker", type=parse_size, metavar="SIZE", help="bytes of data a task holds")


def _lease(parser: argparse.ArgumentParser) -> None:
    from objckpt.options import Options

    default = Options.live_marker_lease
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=default,
        metavar="S",
        help="a save's live marker younger than this keeps its step untouched, whatever the grace"
        f" period (default {default:g}; the saver's Options.live_marker_lease)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="objckpt",
        description="Inspect, check, copy and clean up objckpt checkpoints in any object store.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from objckpt import __version__

    parser.add_argument("--version", action="version", version=f"objckpt {__version__}")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, func: str, help: str) -> argparse.ArgumentParser:
        """A subcommand run by ``objckpt.cli._commands.<func>``, imported only when it runs."""
        p = sub.add_parser(
            name, help=help, description=help, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        p.set_defaults(func=func)
        return p

    p = command("ls", "cmd_ls", "list the steps under a manager root, or the checkpoints under a prefix")
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--replicas",
        nargs="+",
        metavar="URL",
        default=[],
        help="replica roots of ROOT: show which steps exist where (a copy of ROOT's step, another save, partial)",
    )
    _common(p)
    add_store_flags(p)

    p = command("inspect", "cmd_inspect", "show a checkpoint's leaves, dtypes, shapes, sizes, shardings")
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "--item",
        metavar="NAME",
        help="print one leaf: a Json item's document whole (NAME: its path as inspect shows it, or its keys"
        " joined by '/', e.g. config or opt/config)",
    )
    _common(p)
    add_store_flags(p)

    p = command("verify", "cmd_verify", "read every blob and check every checksum")
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "--digest",
        choices=["sha256"],
        help="refuse a checkpoint saved without this digest (its digests are checked whenever it has them)",
    )
    p.add_argument(
        "--no-read",
        dest="read_data",
        action="store_false",
        help="read no blob: compare each blob's size and the crc32c its store keeps (S3, GCS) with the"
        " manifest's (missing, resized, changed and unchecked blobs reported by name)",
    )
    _common(p)
    _tuning(p)
    add_store_flags(p)

    p = command("cp", "cmd_cp", "copy a committed checkpoint to another store (resumable)")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument(
        "--trust-existing",
        action="store_true",
        help="keep blobs already at DST if their size is right, without reading them back",
    )
    p.add_argument(
        "--no-server-side",
        action="store_true",
        help="stream every byte through this machine even where the store could copy server-side",
    )
    p.add_argument(
        "--steps",
        nargs="?",
        const="all",
        metavar="N,M,...",
        help="SRC is a manager root (objckpt's, or Orbax's: converted): copy its committed steps (all, or these)"
        " into DST/step_<N>; without --steps, an objckpt root's steps are all copied",
    )
    _common(p)
    _tuning(p)
    add_store_flags(p, "src")
    add_store_flags(p, "dst")

    p = command("export", "cmd_export", "write a checkpoint as Hugging Face safetensors files (sharded, indexed)")
    p.add_argument("src", metavar="URL")
    p.add_argument("dst", metavar="DEST")
    p.add_argument("--format", default="safetensors", choices=["safetensors"], help="the format written")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", help="largest file, e.g. 2GiB (default 5GiB)")
    p.add_argument("--subtree", metavar="PREFIX", help="export only the leaves under PREFIX (e.g. params)")
    p.add_argument("--dtype", metavar="DTYPE", help="write floating leaves in DTYPE (e.g. bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace an export already at DEST")
    _common(p)
    _tuning(p)
    add_store_flags(p, "src")
    add_store_flags(p, "dst")

    p = command("gc", "cmd_gc", "delete blobs no committed step references (a manager root)")
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=3600.0,
        metavar="S",
        help="also leave objects younger than this alone (default 3600)",
    )
    _lease(p)
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    _common(p)
    add_store_flags(p)

    p = command("rm", "cmd_rm", "delete a checkpoint (manifest first, then its blobs)")
    p.add_argument("url", metavar="URL")
    p.add_argument(
        "--force",
        action="store_true",
        help="also delete objects under URL that no manifest commits, even those of a save in flight",
    )
    p.add_argument(
        "-r",
        "--recursive",
        action="store_true",
        help="URL is a manager root or a prefix of checkpoints: remove every step/checkpoint and all under it",
    )
    _lease(p)
    _common(p)
    add_store_flags(p)
    return parser


def _setup_logging(args: argparse.Namespace) -> Callable[[], None]:
    """objckpt's loggers at the level the flags ask; with ``--debug`` every other logger too.

    Returns the undo: ``main`` may run inside another program (tests, a notebook), so the
    handler and levels it set are taken back when the command ends.

    Every record passes a :class:`~objckpt.logs.RedactingFilter` on the way
    out, whatever logger made it: botocore's, google-auth's and urllib3's
    DEBUG records carry credentials (the STS exchange of web identity
    credentials, token responses), and the command line's own storage-option
    secrets are redacted wherever they show up.
    """
    from objckpt.logs import RedactingFilter

    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s" if args.debug else "%(message)s"))
    handler.addFilter(RedactingFilter(secret_values(*_given_options(args))))
    root, ours = logging.getLogger(), logging.getLogger("objckpt")
    levels = root.level, ours.level
    root.addHandler(handler)
    root.setLevel(level if args.debug else logging.WARNING)
    ours.setLevel(level)

    def undo() -> None:
        root.removeHandler(handler)
        root.setLevel(levels[0])
        ours.setLevel(levels[1])

    return undo


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else ""
    from objckpt.errors import ObjckptError

    if isinstance(error, (ObjckptError, UsageError)) and message:
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``objckpt`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    undo_logging = _setup_logging(args)
    try:
        import objckpt.cli._commands as commands  # after parsing: `--help` and bad command lines need none of it
        from objckpt.transfer.dask_jobs import cluster

        dask = (getattr(args, name, None) for name in ("workers", "scheduler", "memory_per_worker"))
        with cluster(*dask) as args.client:
            return int(getattr(commands, args.func)(args))
    except KeyboardInterrupt:
        print("objckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `objckpt ls ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        secrets = secret_values(*_given_options(args))
        if args.debug:  # the traceback, through the redaction every --debug log record passes
            from objckpt.logs import redact_text

            print(redact_text(scrub("".join(traceback.format_exception(error))), secrets), end="", file=sys.stderr)
        else:
            print(f"objckpt: error: {redact(scrub(_one_line(error)), secrets)}", file=sys.stderr)
        from objckpt.errors import StorageOptionError

        return 2 if isinstance(error, (UsageError, StorageOptionError)) else 1
    finally:
        undo_logging()


def _given_options(args: argparse.Namespace) -> list[dict[str, object]]:
    """The raw ``-o`` pairs as a dict, so their secret values can be scrubbed from messages."""
    out: list[dict[str, object]] = []
    for name in ("storage_option", "src_storage_option", "dst_storage_option"):
        pairs = {}
        for pair in getattr(args, name, None) or []:
            key, _, value = pair.partition("=")
            pairs[key.rsplit(".", 1)[-1]] = value.strip('"')
        out.append(pairs)
    return out
