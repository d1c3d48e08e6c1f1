"""The six commands. Each takes the parsed arguments and returns the exit status."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from objckpt.cli._inspect import show
from objckpt.cli._output import dump, iso_time, table, utc_time
from objckpt.cli._stores import UsageError, options_from_args
from objckpt.core.format import MANIFEST_KEY
from objckpt.errors import CheckpointNotFoundError, SaveInProgressError
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.progress import human_bytes
from objckpt.roots.hints import explained
from objckpt.roots.listing import group_checkpoints, mark_referenced, root_steps
from objckpt.roots.step_names import resolve_step_url
from objckpt.roots.sweep import collect
from objckpt.saving.live_markers import committed_save_id, explain, live_markers
from objckpt.tools.copy import copy
from objckpt.tools.verify import verify
from objckpt.transfer import runtime
from objckpt.transfer.retries import close_store, open_store, opened_store


def _options(args: argparse.Namespace) -> Options:
    kw: dict[str, Any] = {}
    if getattr(args, "concurrency", None):
        kw["max_concurrency"] = args.concurrency
    if getattr(args, "memory_budget", None) or getattr(args, "memory_per_worker", None):
        kw["memory_budget"] = args.memory_per_worker or args.memory_budget
    if getattr(args, "digest", None):
        kw["digest"] = args.digest
    return Options(**kw)


def cmd_ls(args: argparse.Namespace) -> int:
    if getattr(args, "replicas", None):
        from objckpt.cli._replicas import cmd_ls_replicas

        return cmd_ls_replicas(args)
    store = open_store(args.root, options_from_args(args, args.root), Options())
    objects = runtime.run_sync(store.list())
    entries = group_checkpoints(objects, store.url)
    runtime.run_sync(mark_referenced(store, entries, objects, Options().manifest_size_limit))
    base = store.url.rstrip("/")
    if args.json:
        dump(
            [
                {
                    "name": e.name,
                    "step": e.step,
                    "url": f"{base}/{e.name}" if e.name else base,
                    "committed": e.committed,
                    "referenced": e.referenced,
                    "bytes": e.nbytes,
                    "objects": e.objects,
                    "time": iso_time(e.time),
                    "format": e.format,
                }
                for e in entries
            ]
        )
        return 0
    if not entries:
        print(f"no checkpoints under {base}")
        return 0
    steps_only = all(e.step is not None for e in entries)
    with_format = any(e.format != "objckpt" for e in entries)
    header = ["STEP" if steps_only else "CHECKPOINT", "COMMITTED", "SIZE", "OBJECTS", "TIME"]
    header += ["FORMAT"] if with_format else []
    rows = [
        [
            str(e.step) if steps_only else (e.name or "."),
            e.status,
            human_bytes(e.nbytes),
            str(e.objects),
            utc_time(e.time),
        ]
        + ([e.format] if with_format else [])
        for e in entries
    ]
    print(table(header, rows, right={2, 3} | ({0} if steps_only else set())))
    return 0


def _step_url(args: argparse.Namespace, url: str, side: str = "") -> str:
    """``url``, or the step it names the short way (``ROOT/300``, ``ROOT/step_300``)."""
    return resolve_step_url(url, options_from_args(args, url, side))


def cmd_inspect(args: argparse.Namespace) -> int:
    return show(args, _step_url(args, args.url))


def cmd_verify(args: argparse.Namespace) -> int:
    url = _step_url(args, args.url)
    report = verify(
        url,
        read_data=args.read_data,
        storage_options=options_from_args(args, url),
        options=_options(args),
        progress=args.progress,
        client=args.client,
    )
    if args.json:
        dump(report.to_dict())
    else:
        for problem in report.problems:
            print(f"PROBLEM {problem.kind}: {problem}")
        print(report.summary())
    return 0 if report.ok else 1


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy an objckpt checkpoint, or every committed step of an objckpt manager root (``--steps``:
    some), or convert an Orbax one (or, with ``--steps``, an Orbax manager root's steps) into
    objckpt's format."""
    from objckpt.cli._roots import copy_root

    src_options = options_from_args(args, args.src, "src")
    dst_options = options_from_args(args, args.dst, "dst")
    args.src = _step_url(args, args.src, "src")
    if args.steps is not None:
        return _cp_steps(args, src_options, dst_options)
    layout = _layout_of(args.src, src_options, _options(args))
    if layout not in (None, "objckpt"):  # another library's checkpoint: converted into objckpt's format
        return _convert(args, src_options, dst_options, layout)
    try:
        stats: Any = copy(
            args.src,
            args.dst,
            src_storage_options=src_options,
            dst_storage_options=dst_options,
            options=_options(args),
            verify_existing=not args.trust_existing,
            server_side=not getattr(args, "no_server_side", False),
            progress=args.progress,
            client=args.client,
        )
    except CheckpointNotFoundError:
        if layout is None and root_steps(args.src, src_options):  # a manager root: its steps
            return copy_root(args, src_options, dst_options, steps=_parse_steps(args.steps), options=_options(args))
        raise
    if args.json:
        dump(stats.to_dict())
    else:
        print(stats.summary())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint in another format (safetensors): :mod:`objckpt.cli._export`."""
    from objckpt.cli._export import export

    args.src = _step_url(args, args.src, "src")
    try:
        return export(args, _options(args))
    except CheckpointNotFoundError as e:
        storage_options = options_from_args(args, args.src, "src")
        with opened_store(args.src, storage_options, Options()) as store:
            raise explained(e, store, storage_options, Options()) from None


def _layout_of(url: str, storage_options: dict[str, Any], options: Options) -> str | None:
    """What the prefix at ``url`` holds, as :func:`objckpt.layouts.open_checkpoint` decides:
    ``"objckpt"``, another layout's name (``"orbax"``), or None when no layout recognises it."""
    store = open_store(url, storage_options, options)
    try:
        return open_checkpoint(store, options=options, storage_options=storage_options).format
    except CheckpointNotFoundError:
        return None
    finally:
        close_store(store)


def _convert(args: argparse.Namespace, src_options: dict[str, Any], dst_options: dict[str, Any], layout: str) -> int:
    """``cp SRC DST`` where SRC is another library's checkpoint: converted (Orbax's: objckpt.convert_orbax)."""
    if layout != "orbax":
        raise UsageError(f"{args.src} is a {layout} checkpoint: objckpt cp converts Orbax's only")
    from objckpt.orbax.convert import convert_orbax

    converted = convert_orbax(
        args.src,
        args.dst,
        src_storage_options=src_options,
        dst_storage_options=dst_options,
        options=_options(args),
        progress=args.progress,
        client=args.client,
    )
    return _print_conversion(args, [converted])


def _cp_steps(args: argparse.Namespace, src_options: dict[str, Any], dst_options: dict[str, Any]) -> int:
    """``cp ROOT DST --steps [N,...]``: objckpt's steps copied, Orbax's converted (a continued
    Orbax root holds both)."""
    from objckpt.cli._roots import copy_root

    ours, wanted = set(root_steps(args.src, src_options)), _parse_steps(args.steps)
    mine = sorted(ours) if wanted is None else [n for n in wanted if n in ours]
    theirs = None if wanted is None else [n for n in wanted if n not in ours]
    if mine:
        copy_root(args, src_options, dst_options, steps=mine, options=_options(args))
    if theirs == []:
        return 0
    if theirs is not None:
        args.steps = ",".join(map(str, theirs))
    try:
        return _convert_steps(args, src_options, dst_options)
    except CheckpointNotFoundError:
        if not ours:
            raise
        if theirs is None:  # every step, and the root holds no Orbax step
            return 0
        listed = ", ".join(map(str, sorted(ours)))
        raise CheckpointNotFoundError(
            f"no committed step {', '.join(map(str, theirs))} under {args.src}, objckpt's or Orbax's"
            f" (its objckpt steps: {listed})"
        ) from None


def _parse_steps(text: str | None) -> list[int] | None:
    """``--steps``: None for every step (the flag absent, or given alone), else the numbers it names."""
    try:
        return None if text in (None, "all") else [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--steps wants step numbers separated by commas, got {text!r}") from None


def _convert_steps(args: argparse.Namespace, src_options: dict[str, Any], dst_options: dict[str, Any]) -> int:
    from objckpt.orbax.convert import convert_orbax_steps

    steps = _parse_steps(args.steps)
    done = convert_orbax_steps(
        args.src,
        args.dst,
        steps=steps,
        src_storage_options=src_options,
        dst_storage_options=dst_options,
        options=_options(args),
        progress=args.progress,
    )
    if not done:
        raise CheckpointNotFoundError(f"no Orbax steps under {args.src}")
    for step, stats in done.items():
        if stats is None and not args.json:
            print(f"step {step}: already converted, left as it is")
    return _print_conversion(args, [s for s in done.values() if s is not None])


def _print_conversion(args: argparse.Namespace, converted: list[Any]) -> int:
    if args.json:
        dump([dataclasses.asdict(c) for c in converted])
        return 0
    for c in converted:
        gib = c.bytes_read / 2**30
        print(
            f"converted the Orbax checkpoint {c.src} to {c.dst}: {c.leaves} leaves,"
            f" {human_bytes(c.bytes_read)} read, {human_bytes(c.bytes_written)} written in {c.seconds:.2f} s"
            f" ({gib / max(c.seconds, 1e-9):.3f} GiB/s)"
        )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    options = Options()
    root = _step_url(args, args.root)  # `gc ROOT/300` is refused as the step it names
    store = open_store(root, options_from_args(args, root), options)
    from objckpt.cli._roots import refuse_a_checkpoint

    refuse_a_checkpoint(store)
    found = runtime.run_sync(
        collect(
            store,
            grace=args.grace_seconds,
            manifest_size_limit=options.manifest_size_limit,
            lease=args.lease_seconds,
            dry_run=args.dry_run,
        )
    )
    total = sum(o.size for o in found)
    verb = "would delete" if args.dry_run else "deleted"
    if args.json:
        dump({"root": store.url, "dry_run": args.dry_run, "keys": [o.key for o in found], "bytes": total})
        return 0
    for o in found:
        print(f"{verb} {store.url}/{o.key}")
    print(
        f"gc {store.url}: {verb} {len(found)} unreferenced object(s), {human_bytes(total)}"
        f" (grace {args.grace_seconds:g} s)"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    url = _step_url(args, args.url)
    store = open_store(url, options_from_args(args, url), Options())
    objects = runtime.run_sync(store.list())
    keys = {o.key for o in objects}
    nested = sorted(k for k in keys if k.endswith("/" + MANIFEST_KEY))
    if nested and args.recursive:
        from objckpt.cli._roots import remove_root

        return remove_root(args, store, objects)
    if nested:
        raise UsageError(
            f"{store.url} holds other checkpoints ({nested[0].removesuffix('/' + MANIFEST_KEY)}"
            f"{', ...' if len(nested) > 1 else ''}); pass --recursive to remove them all, or remove them one by one"
        )
    if not objects:
        raise CheckpointNotFoundError(f"nothing to remove at {store.url}")
    live = [] if args.force else runtime.run_sync(live_markers(store, lease=args.lease_seconds))
    if live:
        limit = Options().manifest_size_limit
        committed = runtime.run_sync(committed_save_id(store, size_limit=limit)) if MANIFEST_KEY in keys else None
        raise SaveInProgressError(
            f"{explain(store.url, live, lease=args.lease_seconds, committed_save_id=committed)}; nothing removed."
            " Pass --force to remove it anyway (a save still writing then fails at its commit)"
        )
    from objckpt.cli._roots import remove_checkpoint

    return remove_checkpoint(args, store, objects)
