"""``usaf inspect PATH``: what an artifact (or a model directory) is, and whether its files are intact; for a
workspace, an unfinished run or an interrupted output, what usaf left there and how it goes on
(:mod:`usaf.stages.survey`)."""

from __future__ import annotations

from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command
from usaf.cli.options import COMMAND_EXTRAS
from usaf.errors import UsafError


def _run(cli: dict[str, Any], *, json_output: bool, verbose: bool) -> None:
    """Print an artifact's manifest and verify its files, or describe a model directory."""
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.artifacts import MANIFEST_NAME
        from usaf.artifacts.loader import run_of_checkpoint
        from usaf.settings.inspect import InspectConfig

        settings = InspectConfig(**{name: value for name, value in cli.items() if value is not None})
        path, verify, no_hash = settings.path, settings.verify, settings.no_hash
        if verify and no_hash:
            raise UsafError("--verify and --no-hash contradict each other", "--verify always checks every sha256")
        manifest = (path / MANIFEST_NAME).is_file() and not _another_tools_manifest(path / MANIFEST_NAME)
        left = None if verify or manifest else _left_by_usaf(path)
        artifact = manifest or not (path / "config.json").is_file()
        if no_hash and (left is not None or not artifact):  # nothing is hashed there: accepted and unused (in review)
            raise UsafError(f"--no-hash: {path} is no finished usaf artifact, so nothing is hashed", "drop --no-hash")
        if left is not None:
            _print_survey(path, left, as_json=json_output)
        elif not path.exists():
            raise UsafError(f"{path}: no such file or directory", "check the path")
        elif verify and not manifest and _is_run(path):
            _verify_unfinished_run(path, as_json=json_output)
        elif not manifest and (run := run_of_checkpoint(path)) is not None:
            _inspect_checkpoint(path, run, hashes=not no_hash, as_json=json_output)
        elif verify:
            _verify_artifact(path, as_json=json_output)
        elif artifact:
            _inspect_artifact(path, hashes=not no_hash, as_json=json_output)
        else:
            _inspect_model(path, as_json=json_output)


command = settings_command(
    "usaf.settings.inspect:InspectConfig",
    _run,
    extras=COMMAND_EXTRAS,
    doc="Print an artifact's manifest and verify its files, or describe a model directory.",
)


def _another_tools_manifest(file: Path) -> bool:
    """A ``manifest.json`` that is a JSON object without usaf's ``kind`` and ``usaf_version``: another tool's, in a
    model directory (inspect called it "not a usaf manifest ... re-run the stage" where quantize and plan took the
    model; found in review). One usaf cut or garbled still reads as an artifact, to say it is damaged."""
    import json

    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "kind" not in data and "usaf_version" not in data


def _left_by_usaf(path: Path) -> list | None:
    """What usaf left at ``path`` that is no finished artifact: an unfinished run, an interrupted output (``path``
    its target, its work beside it), or a workspace's contents; None where there is none of these (a model
    directory, a user's directory: the usual answers)."""
    from usaf.artifacts.outputs import TMP_TAG
    from usaf.artifacts.writer import ArtifactWriter
    from usaf.stages.survey import describe, survey

    partial = ArtifactWriter.partial_dir(path)
    if not path.exists():
        if partial.is_dir():
            found = describe(partial)
            return [found] if found is not None else None
        # a killed write of an output that never resumes (export, tokenize): its temporaries beside it (the path
        # given was "no such file", where inspect of the workspace listed them; found in review)
        left = [describe(t) for t in sorted(path.parent.glob(f".{glob_escape(path.name)}{TMP_TAG}*"))]
        return [found for found in left if found is not None] or None
    if TMP_TAG in path.name and path.name.startswith("."):  # the temporary itself: no model, whatever it holds
        found = describe(path)
        return [found] if found is not None else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = describe(path)
    if found is not None:
        return [found]
    return survey(path) or None


def _print_survey(path: Path, entries: list, *, as_json: bool) -> None:
    from rich.table import Table

    from usaf.cli.console import out, print_json
    from usaf.units import counted, human_bytes

    if as_json:
        print_json({"path": str(path), "entries": [e.to_dict() for e in entries]})
        return

    def shown(entry) -> str:
        return str(entry.path.relative_to(path)) if entry.path.is_relative_to(path) else str(entry.path)

    table = Table(title=f"what usaf left in {path}", title_justify="left")
    for column in ("state", "kind", "path", "size", "detail"):
        table.add_column(column, justify="right" if column == "size" else "left", overflow="fold")
    for entry in entries:
        detail = entry.detail + (f" [yellow](in use: {entry.in_use})[/yellow]" if entry.in_use else "")
        table.add_row(entry.state, entry.kind, shown(entry), human_bytes(entry.bytes), detail)
    out.print(table)
    for entry in entries:
        if entry.state != "finished":
            out.print(f"  {shown(entry)}: {entry.next}")
    total = sum(entry.bytes for entry in entries)
    out.print(f"{counted(len(entries), 'entry')}, {human_bytes(total)}")


def _flatten(prefix: str, value: Any, rows: list[tuple[str, str]], *, limit: int = 12) -> None:
    """Nested manifest values as ``a.b.c: value`` rows; long lists are summarised."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, rows, limit=limit)
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        rows.append((prefix, f"{len(value)} entries"))
        for i, item in enumerate(value[:limit]):
            _flatten(f"{prefix}[{i}]", item, rows, limit=limit)
        if len(value) > limit:
            rows.append((f"{prefix}[...]", f"{len(value) - limit} more (see --json)"))
    else:
        rows.append((prefix, str(value)))


def _inspect_artifact(path: Path, *, hashes: bool, as_json: bool) -> None:
    from rich.table import Table

    from usaf.artifacts import MANIFEST_NAME, load_manifest, verify_files
    from usaf.artifacts.loader import manifest_problem
    from usaf.cli.console import out, print_json
    from usaf.cli.progress import RichProgress

    manifest = load_manifest(path)
    checks = verify_files(path, manifest, hashes=hashes, progress=RichProgress())
    bad = [c for c in checks if not c.ok]
    problem = manifest_problem(manifest)  # no file read: checked with --no-hash too
    if as_json:
        print_json(
            {
                "path": str(path),
                "manifest": manifest.model_dump(mode="json"),
                "verified": not bad and problem is None,
                "hashes_checked": hashes,
                "problems": [{"path": c.path, "problem": c.problem} for c in bad]
                + ([{"path": MANIFEST_NAME, "problem": problem}] if problem else []),
            }
        )
    else:
        table = Table(title=f"{manifest.kind} artifact: {path}", title_justify="left", show_header=False)
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        data = manifest.model_dump(mode="json")
        files = data.pop("files")
        rows: list[tuple[str, str]] = []
        _flatten("", data, rows)
        for key, value in rows:
            table.add_row(key, value)
        out.print(table)
        files_table = Table(title="files", title_justify="left")
        for column in ("path", "bytes", "sha256", "status"):
            files_table.add_column(column, justify="right" if column == "bytes" else "left")
        for record, check in zip(files, checks):
            # --no-hash checks sizes alone: "ok" beside a sha256 column read as a matching hash (found in review)
            good = "[green]ok[/green]" if hashes else "[green]size ok, unhashed[/green]"
            status = good if check.ok else f"[red]{check.problem}[/red]"
            files_table.add_row(record["path"], f"{record['bytes']:,}", record["sha256"][:16], status)
        out.print(files_table)
    if bad:
        raise UsafError(
            f"{path}: {len(bad)} of {len(checks)} files fail verification ({bad[0].path}: {bad[0].problem})",
            "re-run the stage that made this artifact",
        )
    if problem is not None:
        raise UsafError(f"{path / MANIFEST_NAME}: {problem}", "re-run the stage that made this artifact")


def _verify_artifact(path: Path, *, as_json: bool) -> None:
    """``--verify``: every listed file re-hashed against the manifest, the fingerprint against the files; one
    verdict line."""
    from usaf.artifacts import MANIFEST_NAME, load_manifest, verify_files
    from usaf.artifacts.loader import manifest_problem, unlisted_files
    from usaf.artifacts.outputs import run_working_file
    from usaf.artifacts.run import PLAN_DIR
    from usaf.cli.console import note, out, print_json
    from usaf.cli.progress import RichProgress
    from usaf.units import counted, first_few

    manifest = load_manifest(path)
    checks = verify_files(path, manifest, hashes=True, progress=RichProgress())
    bad = [c for c in checks if not c.ok]
    problem = manifest_problem(manifest)  # the files match, the manifest lies
    extra = unlisted_files(path, manifest)
    checkpoints = _checkpoint_checks(path) if manifest.kind == "run" else []
    # a run directory also holds its metrics and checkpoints, which its manifest does not cover (the checkpoints'
    # own checksums do: said below)
    uncovered = [f for f in extra if not any(f.startswith(c["path"] + "/") for c in checkpoints)]
    if as_json:  # a changed checkpoint is a problem, and its files are not "unlisted" (they were; found in review)
        print_json(
            {
                "path": str(path),
                "kind": manifest.kind,
                "fingerprint": manifest.fingerprint,
                "verified": not bad and problem is None and not _changed(checkpoints),
                "files": len(checks),
                "problems": [{"path": c.path, "problem": c.problem} for c in bad]
                + ([{"path": MANIFEST_NAME, "problem": problem}] if problem else [])
                + [{"path": f, "problem": "not as usaf wrote it (its checkpoint's checksums.json differs)"
                    if (path / f).exists() else "missing"} for f in _changed(checkpoints)],
                "unlisted": uncovered,
                **({"checkpoints": checkpoints} if manifest.kind == "run" else {}),
            }
        )
    # a run's log and settings are usaf's, written as it trained: named as files "not listed in the manifest", a
    # fresh run read as something wrong (found in review)
    own = [f for f in uncovered if manifest.kind == "run" and run_working_file(f)]
    plan = [f for f in own if f.startswith(f"{PLAN_DIR}/") or f.startswith(f".{PLAN_DIR}")]
    if log := [f for f in own if f not in plan]:
        note(f"{first_few(log)}: the run's own log, settings and working files, written as it trained; its manifest "
             "does not cover them")  # fmt: skip
    if plan:  # "the run's own log and settings" of its plan's files, and the list cut at five (found in review)
        note(f"{counted(len(plan), 'file')} of the plan the run scored for itself ({PLAN_DIR}/, verified by usaf "
             f"inspect {path / PLAN_DIR} --verify); the run's manifest does not cover them")  # fmt: skip
    if others := [f for f in uncovered if f not in own]:
        are = "1 file is" if len(others) == 1 else f"{len(others)} files are"
        note(f"{are} not listed in the manifest (not covered by it): {', '.join(others[:5])}")
    if manifest.manifest_sha256 is None:
        note(f"{MANIFEST_NAME} has no checksum of its own (an older usaf wrote it): an edit to it would not show here")
    if bad:
        listing = "; ".join(f"{c.path}: {c.problem}" for c in bad[:5])
        raise UsafError(
            f"{path}: {len(bad)} of {len(checks)} files fail verification: {listing}",
            "re-run the stage that made this artifact",
        )
    if problem is not None:
        raise UsafError(f"{path / MANIFEST_NAME}: {problem}", "re-run the stage that made this artifact")
    if checkpoints:  # before the verdict: "verified" was printed, then a changed checkpoint refused (found in review)
        _say_checkpoints(path, checkpoints, as_json=as_json)
    if not as_json:
        out.print(
            f"{path}: {manifest.kind} artifact verified: {len(checks)} files match their sha256 "
            f"(fingerprint {manifest.fingerprint[:16]})"
        )


def _is_run(path: Path) -> bool:
    """An unfinished run: usaf train's settings file, no manifest yet."""
    from usaf.artifacts.run import SETTINGS_FILE

    return (path / SETTINGS_FILE).is_file()


def _checkpoint_checks(run: Path, *, hashes: bool = True) -> list[dict[str, Any]]:
    """Each checkpoint of ``run`` against its checksums: its path, and the files that do not match (None: a
    checkpoint of a usaf from before checksums, not checked). A checkpoint without its ``checksums.json`` that had
    one (``lost_checksums``) was passed as "a usaf from before checksums" (found in review). Without
    ``hashes`` (``--no-hash``), the files missing alone: the records hold no sizes to check instead."""
    from usaf.artifacts.run import CHECKPOINTS_DIR, SUMS_FILE, changed_checkpoint_files, lost_checksums

    # every step-N, not only those with a state.json (checkpoint_dirs, resume's complete ones): a checkpoint is renamed
    # into place whole, so one without it lost it, and the run verified clean without that checkpoint (review)
    directories = sorted(d for d in (run / CHECKPOINTS_DIR).glob("step-*")
                         if d.is_dir() and not d.name.endswith(".tmp"))  # fmt: skip
    changed = changed_checkpoint_files if hashes else _missing_checkpoint_files
    checks = [{"path": str(d.relative_to(run)), "changed": changed(d)} for d in directories]
    for c in checks:  # one whose state.json says it had its checksums.json, or beside others with theirs, lost it
        if c["changed"] is None and lost_checksums(run / c["path"]):
            c["changed"] = [SUMS_FILE]
    return [_with_missing(run, c) for c in checks]


def _with_missing(run: Path, check: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's check with the files of its ``changed`` that are not there: ``--json`` listed a deleted file
    as changed, and a script could not tell the two apart (found in review)."""
    missing = [name for name in check["changed"] or () if not (run / check["path"] / name).exists()]
    return {**check, "missing": missing}


def _missing_checkpoint_files(directory: Path) -> list[str]:
    """``--no-hash``: a checkpoint's files that are not there (none is read)."""
    from usaf.artifacts.run import CHECKPOINT_FILES

    return [name for name in CHECKPOINT_FILES if not (directory / name).is_file()]


def _changed(checks: list[dict[str, Any]]) -> list[str]:
    return [f"{c['path']}/{name}" for c in checks for name in c["changed"] or ()]


def _say_checkpoints(
    run: Path, checks: list[dict[str, Any]], *, as_json: bool, hashes: bool = True, instead: str | None = None
) -> None:
    """The checkpoints' verdict: refused where a file changed or is missing (``instead``: the hint, where there is a
    better one than moving them out), else a line (a note for those not checked). A deleted file was said to differ
    from its sha256 (found in review)."""
    from usaf.cli.console import note, out
    from usaf.units import counted

    if changed := _changed(checks):
        missing = [f for f in changed if not (run / f).exists()]
        edited = [f for f in changed if f not in missing]
        said = [f"{counted(len(missing), 'checkpoint file')} missing: {', '.join(missing[:5])}"] if missing else []
        if edited:
            them = "it" if len(edited) == 1 else "them"
            # a file cut short was said to differ in sha256 alone, where other commands say "truncated?" (review)
            differs = ("the sha256 recorded differs: edited, or cut short" if hashes
                       else "its size is not the one the run's manifest lists")  # fmt: skip
            said.append(f"{counted(len(edited), 'checkpoint file')} not as usaf wrote {them} ({differs}): "
                        f"{', '.join(edited[:5])}")  # fmt: skip
        raise UsafError(f"{run}: {'; '.join(said)}",
                        instead or "move the damaged checkpoints out of the run (resume, eval and export refuse them)")
    unchecked = [c["path"] for c in checks if c["changed"] is None]
    if unchecked:
        note(f"{counted(len(unchecked), 'checkpoint')} of a usaf from before checksums, not checked: "
             f"{', '.join(unchecked[:5])}")  # fmt: skip
    if not as_json and len(checks) > len(unchecked):
        checked = len(checks) - len(unchecked)
        if hashes:
            out.print(f"{run}: {counted(checked, 'checkpoint')} {'matches its' if checked == 1 else 'match their'} "
                      "checksums")  # fmt: skip
        else:  # --no-hash was hashed anyway, 'matches its checksums' (found in review)
            out.print(f"{run}: {counted(checked, 'checkpoint')} with all {'its' if checked == 1 else 'their'} "
                      "files, not hashed (--no-hash)")  # fmt: skip


def _inspect_checkpoint(path: Path, run: Path, *, hashes: bool, as_json: bool) -> None:
    """A checkpoint directory (``checkpoints/step-N``, ``final``), which eval, export and generate take as
    ``--checkpoint``: its step and losses, and its files against its checksums. It was refused as "not a usaf
    artifact (no manifest.json)" (found in review)."""
    import json

    from usaf.artifacts import MANIFEST_NAME
    from usaf.artifacts.run import (
        FINAL_DIR,
        SETTINGS_FILE,
        STATE_FILE,
        SUMS_FILE,
        changed_checkpoint_files,
        lost_checksums,
        newest_intact_checkpoint,
    )
    from usaf.cli.console import out, print_json

    if not (run / SETTINGS_FILE).is_file():  # a checkpoint copied out of its run (found in review)
        raise UsafError(f"{path}: a checkpoint whose run {run} has no {SETTINGS_FILE}: eval, export and generate "
                        "refuse it", f"pass the checkpoint inside its run, or copy its {SETTINGS_FILE} back there")
    every = _checkpoint_checks(run, hashes=hashes)
    checks = [c for c in every if (run / c["path"]).resolve() == path.resolve()]
    if not checks:  # "final", which is no step-N: its own record, and the run's manifest, which lists its files
        finished = (run / MANIFEST_NAME).is_file()
        changed = changed_checkpoint_files(path) if hashes else _missing_checkpoint_files(path)
        if changed is None and lost_checksums(path):
            changed = [SUMS_FILE]
        if finished:  # its files, checksums.json too, by the manifest: another checkpoint copied over final passed
            changed = sorted({*(changed or ()), *_failing_in_manifest(run, FINAL_DIR, hashes=hashes)})
        checks = [_with_missing(run, {"path": FINAL_DIR, "changed": changed})]
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = {}
    state = state if isinstance(state, dict) else {}
    shown = {key: state.get(key) for key in ("step", "tokens", "first_loss", "last_loss")}
    if as_json:
        print_json({"path": str(path), "kind": "checkpoint", "run": str(run), **shown,
                    "verified": not _changed(checks), "hashes_checked": hashes, "checkpoints": checks})  # fmt: skip
    elif not _changed(checks):  # "eval, export and generate take it" was printed of a damaged one (review)
        # single steps, said as such: "loss a → b" read as the run's trend, which the means of the manifest are (review)
        losses = (f", the loss of step 1 {shown['first_loss']:.4f} and of step {shown['step']} {shown['last_loss']:.4f}"
                  if isinstance(shown["first_loss"], float) and isinstance(shown["last_loss"], float) else "")
        out.print(f"{path}: a checkpoint of the run {run}, at step {shown['step']}{losses}; eval, export and "
                  f"generate take it as --checkpoint", markup=False, highlight=False)  # fmt: skip
    intact = newest_intact_checkpoint(run) if path.name == FINAL_DIR and _changed(checks) else None
    # "move the damaged checkpoints out of the run" of final/ led nowhere: the run was still refused (review)
    instead = None if intact is None else (f"eval, export and generate take its newest intact checkpoint, "
                                           f"--checkpoint {intact}")  # fmt: skip
    _say_checkpoints(run, checks, as_json=as_json, hashes=hashes, instead=instead)


def _failing_in_manifest(run: Path, directory: str, *, hashes: bool) -> list[str]:
    """The files of ``run``'s ``directory`` whose size or sha256 (with ``hashes``) is not what the run's manifest
    lists (names within it): ``final`` is in the run's manifest, and another checkpoint copied over it passed its
    own checksums."""
    from usaf.artifacts import load_manifest
    from usaf.artifacts.loader import verify_files

    checks = verify_files(run, load_manifest(run), hashes=hashes)
    return [c.path.removeprefix(f"{directory}/") for c in checks if not c.ok and c.path.startswith(f"{directory}/")]


def _verify_unfinished_run(run: Path, *, as_json: bool) -> None:
    """``--verify`` on a run still training or interrupted: no manifest yet, so its checkpoints' own checksums."""
    from usaf.cli.console import print_json

    checks = _checkpoint_checks(run)
    if as_json:
        print_json({"path": str(run), "kind": "run", "finished": False, "verified": not _changed(checks),
                    "checkpoints": checks})  # fmt: skip
    if not checks:
        raise UsafError(f"{run}: an unfinished usaf run with no checkpoint yet: nothing to verify",
                        f"usaf inspect {run} says how it goes on")  # fmt: skip
    _say_checkpoints(run, checks, as_json=as_json)


def _inspect_model(path: Path, *, as_json: bool) -> None:
    from rich.table import Table

    from usaf.cli.console import out, print_json
    from usaf.families import describe_model

    description = describe_model(path)
    if as_json:
        print_json({"path": str(path), "model": description.to_dict()})
        return
    table = Table(title=f"model: {path}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in description.rows():
        table.add_row(key, value)
    out.print(table)
