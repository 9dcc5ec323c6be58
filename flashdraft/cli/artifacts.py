"""The artifact commands: manifest, verify, sync."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from flashdraft.cli.app import (
    JsonFlag,
    app,
    emit_json,
    err_console,
    fail,
    human,
)
from flashdraft.redact import redact


@app.command()
def manifest(
    directory: Annotated[Path, typer.Argument(help="Directory of files to describe.")],
    kind: Annotated[str, typer.Option(help="Artifact kind recorded in the manifest.")] = "files",
    json_out: JsonFlag = False,
) -> None:
    """Build manifest.json (size + sha256 of every file) for an existing directory."""
    from flashdraft.artifact.manifest import KINDS, describe_directory, write_manifest

    if kind not in KINDS:
        fail(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    if not directory.is_dir():
        fail(f"{directory} is not a directory")
    if (existing := _artifact_kind(directory)) not in (None, "files"):
        fail(f"{directory} is a {existing} artifact whose stage wrote its manifest (stats, lineage); "
             f"check it with `flashdraft verify {directory}` rather than replacing it")
    built = describe_directory(directory, kind=kind)
    digest = write_manifest(directory, built)
    summary = f"{len(built.files)} files, {built.total_bytes:,} bytes"
    human(json_out).print(f"manifest: {directory}/manifest.json — {summary}")
    if json_out:
        emit_json({"path": str(directory), "files": len(built.files), "bytes": built.total_bytes, "sha256": digest})


def _artifact_kind(directory: Path) -> str | None:
    from flashdraft.artifact.manifest import ManifestError, read_manifest

    try:
        return read_manifest(directory).kind
    except ManifestError:
        return None


ProfileFlag = Annotated[str | None, typer.Option(help="AWS profile (credentials stay in ~/.aws, never in flags).")]
EndpointFlag = Annotated[str | None, typer.Option(help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS).")]


def _open_store(location: str, profile: str | None, endpoint_url: str | None, jobs: int = 8):
    from flashdraft.artifact.store import open_store

    return open_store(location, profile=profile, endpoint_url=endpoint_url, jobs=jobs)


def _report_problems(where: str, problems: list, json_out: bool) -> None:
    for p in problems:
        err_console.print(Text.assemble(("✗", "red"), " ", redact(str(p))))
    verdict = f"NOT verified, {len(problems)} problem(s)" if problems else "verified"
    human(json_out).print(f"verify: {where} — {verdict}", soft_wrap=True)
    if json_out:
        emit_json({"ok": not problems, "problems": [{"path": p.path, "problem": p.problem} for p in problems]})
    if problems:
        raise typer.Exit(1)


@app.command()
def verify(
    path: Annotated[str, typer.Argument(help="Artifact directory or s3://bucket/prefix.")],
    deep: Annotated[
        bool, typer.Option(help="Stores: download and re-hash every object. Local directories are always re-hashed.")
    ] = False,
    profile: ProfileFlag = None,
    endpoint_url: EndpointFlag = None,
    json_out: JsonFlag = False,
) -> None:
    """Check an artifact against its manifest: every file present, same size and hash, nothing unlisted."""
    from flashdraft.artifact.manifest import verify_dir
    from flashdraft.artifact.store import is_url
    from flashdraft.artifact.sync import verify_store

    if is_url(path):
        from flashdraft.artifact.manifest import MANIFEST
        from flashdraft.artifact.store import StoreError

        store = _open_store(path, profile, endpoint_url)
        try:  # no credentials, a refused key, the endpoint down: the store was not asked, so no verdict on the artifact
            store.read_bytes(MANIFEST)
        except StoreError as e:
            fail(f"verify: {path} — cannot check (no verdict on the artifact): {e}")
        problems = verify_store(store, deep=deep)
    elif Path(path).is_dir():
        problems = verify_dir(path)
    else:
        fail(f"{path} is not a directory")
    _report_problems(path, problems, json_out)


class Direction(StrEnum):
    push = "push"
    pull = "pull"


@app.command()
def sync(
    direction: Annotated[Direction, typer.Argument(help="push (directory → store) or pull (store → directory).")],
    src: Annotated[str, typer.Argument(help="Source artifact: directory (push) or s3://bucket/prefix (pull).")],
    dst: Annotated[str, typer.Argument(help="Destination: s3://bucket/prefix or directory (push), directory (pull).")],
    delete: Annotated[bool, typer.Option(help="Remove destination files the manifest does not list.")] = False,
    jobs: Annotated[int, typer.Option(help="Parallel transfers.")] = 8,
    part_size_mb: Annotated[int | None, typer.Option(
        help="Multipart part size; larger files go multipart. Default: each file whole when there are at "
             "least --jobs files to send, else 8 MB parts.")] = None,
    force: Annotated[bool, typer.Option(
        help="push: replace an artifact of another kind or lineage at DST (refused without it).")] = False,
    profile: ProfileFlag = None,
    endpoint_url: EndpointFlag = None,
    verbose: Annotated[bool, typer.Option(help="Debug logging (credentials are redacted).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Copy an artifact by content (hash), manifest last, and verify it at the destination."""
    from flashdraft.artifact.store import is_url
    from flashdraft.artifact.sync import VerifyFailed, pull, push

    if direction is Direction.push and is_url(src):
        fail("push copies a local directory to a store: SRC must be a directory (did you mean pull?)")
    if direction is Direction.pull and is_url(dst):
        fail("pull copies a store artifact into a local directory: DST must be a directory")
    remote = dst if direction is Direction.push else src
    store = _open_store(remote, profile, endpoint_url, jobs)
    if verbose:
        _debug_logging(store.redactor if hasattr(store, "redactor") else None)
    try:
        if direction is Direction.push:
            result = push(
                Path(src),
                store,
                delete=delete,
                jobs=jobs,
                part_size=part_size_mb << 20 if part_size_mb else None,
                force=force,
                console=err_console,
                log=human(json_out).print,
            )
        else:
            result = pull(store, Path(dst), delete=delete, jobs=jobs, console=err_console)
    except VerifyFailed as e:  # a refusal or a failed check: one line, the problems (paths) named in it
        if json_out:
            emit_json({"ok": False, "problems": [{"path": p.path, "problem": p.problem} for p in e.problems]})
        fail(f"{direction.value}: {e}")
    human(json_out).print(result.line(), soft_wrap=True)
    if json_out:
        emit_json(result.to_json())


def _debug_logging(redactor) -> None:
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    if redactor is not None:
        handler.addFilter(redactor)
    logging.basicConfig(level=logging.DEBUG, handlers=[handler], force=True)
