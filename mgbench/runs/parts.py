"""Runs written group by group: resumable after a crash (even kill -9), published by rename.

While a run decodes, each finished group of requests is committed to a staging folder: its
table parts first, then a small JSON record that marks the group done. `--resume` reopens the
folder, checks that the options are the same, and decodes only the groups without a record.
At the end the parts are concatenated in group order, so a resumed run publishes the same
tables as an uninterrupted one, and then published:

- one process: the staging folder `.NAME.partial` sits beside the run directory, which appears
  complete at once (rundir.publish_run);
- shard I of N: the staging folder `.shard-I-of-N.partial` sits inside the run directory; the
  shard's tables become `TABLE/part-I-of-N.parquet`, then `shards/I-of-N.json` marks it done;
  the shard that completes the set writes summary.json and manifest.json for the whole run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from mgbench.errors import NothingToDo, UserError
from mgbench.runs import rundir
from mgbench.runs.shards import Shard

RUN_RECORD = "run.json"
PARTS = "parts"


def staging_path(out: Path, shard: Shard) -> Path:
    return out / f".shard-{shard.label}.partial" if shard.sharded else out.parent / f".{out.name}.partial"


def _write_json(document: dict, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(rundir.json_text(document))
    os.replace(temporary, path)


def _write_parquet(table: pa.Table, path: Path) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary)
    os.replace(temporary, path)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key old -> new' for every key whose value differs (nested dicts as dotted keys)."""
    keys = sorted(set(old) | set(new))
    lines = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key} {_short(a)} -> {_short(b)}")
    return lines


class RunWriter:
    """The staging folder of one run (or one shard of it), held under an exclusive lock."""

    def __init__(self, out: Path, shard: Shard, fingerprint: dict, resume: bool):
        self.out, self.shard = out, shard
        # JSON round trip: tuples become lists, so a resumed fingerprint compares equal.
        self.fingerprint = json.loads(rundir.json_text({**fingerprint, "shards": shard.count}))
        self.staging = staging_path(out, shard)
        # A shard that published but crashed before the run's summary was written: --resume
        # only writes the summary (nothing to decode, no model needed).
        self.finishing_only = False
        self._check_target(resume)
        if self.finishing_only:
            return
        existed = self.staging.exists()
        try:
            self._open(resume)
        except BaseException:
            self._unlock()
            if not existed:
                shutil.rmtree(self.staging, ignore_errors=True)
            raise

    # -- opening ---------------------------------------------------------------------------------

    def _check_target(self, resume: bool) -> None:
        if not self.shard.sharded:
            if resume and rundir.is_complete_run(self.out):
                raise UserError(f"--resume: {self.out} is already complete; nothing to resume")
            rundir.prepare_out_dir(self.out)
            return
        rundir.prepare_out_dir(self.out, sharded=True)
        for document in rundir.shard_documents(self.out):
            if document.get("fingerprint") != self.fingerprint:
                changed = "; ".join(differences(document.get("fingerprint") or {}, self.fingerprint)[:3])
                raise UserError(
                    f"--out {self.out} holds shards of a different run ({changed}); "
                    "use the same options for every shard, or another --out"
                )
        marker = rundir.shard_marker(self.out, self.shard)
        if not marker.exists():
            return
        if not resume:
            raise UserError(f"shard {self.shard} of {self.out} is already complete; choose another --out or shard")
        if not rundir.is_complete_run(self.out) and not rundir.missing_shards(self.out):
            self.finishing_only = True
            return
        # Exit 0, writing nothing: under torchrun a failing rank would stop the ranks still resuming.
        waiting = rundir.missing_shards(self.out)
        raise NothingToDo(
            f"shard {self.shard} of {self.out} is already complete; nothing to resume"
            + (f" (waiting for shard {', '.join(waiting)})" if waiting else "")
        )

    def _open(self, resume: bool) -> None:
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            (self.staging / PARTS).mkdir(exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {self.out}: cannot create {self.staging} ({exc.strerror})") from exc
        self._lock()
        record = self.staging / RUN_RECORD
        done = self.done_groups()
        if done and not resume:
            raise UserError(
                f"{self.staging} holds an interrupted run ({len(done)} group(s) of requests done): add --resume to "
                f"continue it, or delete that folder to start over"
            )
        if done:
            recorded = json.loads(record.read_text()) if record.exists() else {}
            if recorded != self.fingerprint:
                changed = "; ".join(differences(recorded, self.fingerprint)[:3])
                raise UserError(
                    f"--resume: the interrupted run in {self.staging} used other options ({changed}); "
                    "rerun with its options, or delete that folder to start over"
                )
        _write_json(self.fingerprint, record)

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock, one writer is assumed
            return
        self._lock_file = open(self.staging / ".lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another mgbench process is writing {self.staging}; wait for it or stop it") from None

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """On failure keep committed groups for --resume; leave nothing behind when there are none."""
        if kind is None:
            return
        if self.staging.exists() and not self.done_groups():
            self.discard()
        else:
            self._unlock()

    # -- groups ----------------------------------------------------------------------------------

    def done_groups(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in (self.staging / PARTS).glob("group-*.json")}

    def commit(self, group: int, tables: dict[str, pa.Table], record: dict) -> None:
        """Parts first, then the record: a group without its record is decoded again on resume."""
        for name, table in tables.items():
            _write_parquet(table, self.staging / PARTS / f"{name}-{group:05d}.parquet")
        _write_json(record, self.staging / PARTS / f"group-{group:05d}.json")

    def records(self) -> list[dict]:
        return [
            json.loads((self.staging / PARTS / f"group-{g:05d}.json").read_text()) for g in sorted(self.done_groups())
        ]

    def table(self, name: str, schema: pa.Schema) -> pa.Table:
        """All committed parts of a table, in group order."""
        paths = [self.staging / PARTS / f"{name}-{g:05d}.parquet" for g in sorted(self.done_groups())]
        if not paths:
            return schema.empty_table()
        return pa.concat_tables([pq.read_table(p, schema=schema) for p in paths])

    # -- publication -----------------------------------------------------------------------------

    def publish(
        self, tables: dict[str, pa.Table], documents: dict[str, dict], finish: Callable[[], tuple[dict, dict]]
    ) -> bool:
        """Publish this run or shard; True when the whole run is now complete.

        For a shard, `finish()` -> (summary, manifest) of the whole run is called by the shard
        that completes the set."""
        if not self.shard.sharded:
            rundir.publish_run(self.out, tables, documents)
            self.discard()
            return True
        for name, table in tables.items():
            (self.out / name).mkdir(exist_ok=True)
            _write_parquet(table, self.staging / f"{name}.parquet")
        for name in tables:
            os.replace(self.staging / f"{name}.parquet", rundir.shard_part(self.out, name, self.shard))
        marker = rundir.shard_marker(self.out, self.shard)
        marker.parent.mkdir(exist_ok=True)
        _write_json({"fingerprint": self.fingerprint, "shard": str(self.shard), **documents}, marker)
        self.discard()
        if rundir.missing_shards(self.out):
            return False
        self.write_run_documents(*finish())
        return True

    def write_run_documents(self, summary: dict, manifest: dict) -> None:
        """The whole sharded run's summary, then its manifest: a run with a manifest is complete."""
        _write_json(summary, self.out / "summary.json")
        _write_json(manifest, self.out / "manifest.json")

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self._unlock()

    def _unlock(self) -> None:
        if getattr(self, "_lock_file", None) is not None:
            self._lock_file.close()
            self._lock_file = None


def owned_groups(group_count: int, shard: Shard) -> list[int]:
    owned = [g for g in range(group_count) if shard.owns(g)]
    if not owned:
        raise UserError(
            f"shard {shard} gets no requests: the run has {group_count} group(s) of requests "
            f"(one per largest batch size); use at most {group_count} shards"
        )
    return owned


def finish_run(
    writer: RunWriter,
    schemas: dict[str, pa.Schema],
    summarize: Callable[[dict[str, pa.Table], list[dict]], dict],
    manifest: dict | None,
    streamed: tuple[str, ...] = (),
) -> tuple[dict, bool]:
    """Publish the committed groups; (summary of this process's groups, whole run complete?).

    `summarize(tables, group records)` computes a summary from tables alone (plus the timings
    kept in the group records), so the merged summary of a sharded run is the same function.
    `manifest` is None when the writer is only finishing a sharded run (see RunWriter). The
    tables named in `streamed` reach the merged summary as their shards' part files (a list of
    paths, for `summarize` to stream), not merged in memory."""

    def finish() -> tuple[dict, dict]:
        shards = rundir.shard_documents(writer.out)
        out = writer.out
        merged = {
            name: rundir.table_files(out, name) if name in streamed else rundir.read_run_table(out, name, schema)
            for name, schema in schemas.items()
        }
        merged_records = [record for document in shards for record in document["groups"]]
        return summarize(merged, merged_records), {
            **shards[0]["manifest"],
            "shard": None,
            "shard_manifests": [d["manifest"] for d in shards],
        }

    if writer.finishing_only:
        summary, run_manifest = finish()
        writer.write_run_documents(summary, run_manifest)
        return summary, True
    tables = {name: writer.table(name, schema) for name, schema in schemas.items()}
    records = writer.records()
    summary = summarize(tables, records)
    documents = {"summary": summary, "manifest": manifest}
    if writer.shard.sharded:
        documents["groups"] = records
    return summary, writer.publish(tables, documents, finish)
