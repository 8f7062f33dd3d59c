"""Run directories: read (whole or sharded), described by a manifest, published atomically.

A run directory holds steps.parquet, sequences.parquet, summary.json and manifest.json. It is
written into a hidden staging folder beside the target and renamed into place at the end, so
a crash never leaves a directory that looks complete. A sharded run directory holds each table
as a folder of parts (steps/part-I-of-N.parquet, one per shard: a pyarrow dataset), one
shards/I-of-N.json per finished shard, and summary.json and manifest.json once all are in.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mgbench import SCHEMA_VERSION, __version__
from mgbench.errors import UserError
from mgbench.runs.machine import kernel_environment
from mgbench.runs.schema import read_table


def shard_part(run: Path, table: str, shard) -> Path:
    return run / table / f"part-{shard.label}.parquet"


def shard_marker(run: Path, shard) -> Path:
    return run / "shards" / f"{shard.label}.json"


def shard_documents(run: Path) -> list[dict]:
    """The records of a sharded run's finished shards (summary, manifest, fingerprint of each)."""
    return shard_documents_of(sorted((run / "shards").glob("*.json")))


def shard_documents_of(paths: list[Path]) -> list[dict]:
    documents = []
    for path in paths:
        try:
            documents.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: cannot read this shard record ({exc})") from exc
    return documents


def read_own_table(run: Path, name: str, expected: pa.Schema, shard) -> pa.Table:
    """The table this process wrote: the run's, or only its shard's part of a sharded run."""
    return read_table(shard_part(run, name, shard) if shard.sharded else run / f"{name}.parquet", expected)


def shard_count(run: Path) -> int | None:
    """N of a sharded run, from its first finished shard's record; None when none has finished."""
    first = next(iter(sorted((run / "shards").glob("*.json"))), None)
    return None if first is None else shard_documents_of([first])[0]["fingerprint"]["shards"]


def missing_shards(run: Path) -> list[str]:
    """Shards (I/N) of a sharded run directory that have not finished; ['all'] when none has."""
    from mgbench.runs.shards import Shard

    count = shard_count(run)
    if count is None:
        return ["all"]
    return [str(Shard(i, count)) for i in range(count) if not shard_marker(run, Shard(i, count)).exists()]


def check_shards_complete(run: Path) -> int:
    """The shard count of a sharded run, refused while any shard is unfinished."""
    missing = missing_shards(run)
    if missing:
        raise UserError(
            f"{run} is incomplete: unfinished shards: {', '.join(missing)}; run each with --shard I/N "
            "and the same --out (add --resume after a crash)"
        )
    return shard_count(run)


def is_complete_run(run: Path) -> bool:
    return (run / "manifest.json").is_file()


# Rows of a run's tables are ordered by batch, row and step; merged shards are put back in it.
CANONICAL_ORDER = ("batch_id", "row", "step")


def table_files(run: Path, name: str) -> list[Path]:
    """The Parquet files of table `name` in a run directory: [NAME.parquet], or a sharded run's
    parts in shard order (refused while a shard is unfinished)."""
    single = run / f"{name}.parquet"
    if single.is_file():
        return [single]
    if not ((run / name).is_dir() or looks_sharded(run)):
        raise UserError(f"{run} is not a run directory (no {name}.parquet)")
    count = check_shards_complete(run)
    from mgbench.runs.shards import Shard

    return [shard_part(run, name, Shard(i, count)) for i in range(count)]


def read_run_table(run: Path, name: str, expected: pa.Schema) -> pa.Table:
    """Table `name` of a run directory: NAME.parquet, or the parts of a sharded run merged in the
    order one process would have written them."""
    files = table_files(run, name)
    if files == [run / f"{name}.parquet"]:
        return read_table(files[0], expected)
    merged = pa.concat_tables([read_table(path, expected) for path in files])
    keys = [(key, "ascending") for key in CANONICAL_ORDER if key in merged.schema.names]
    return merged.sort_by(keys) if keys else merged


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_revision() -> str:
    """The commit mgbench runs from (12 digits), marked when its package has uncommitted changes:
    what a benchmark's figures ran on."""
    revision = git_revision()[:12]
    if revision == "unknown":
        return revision
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "."],
            cwd=Path(__file__).parents[1],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return revision
    return revision + (" + uncommitted changes in mgbench/" if status.strip() else "")


def device_name(device: str) -> str:
    from mgbench.runs.machine import cpu_name

    torch = sys.modules.get("torch")
    if torch is None:  # a run that computed nothing with torch (calibrate on recorded runs)
        return cpu_name()
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})"


def peak_memory(device: str) -> dict:
    """The most memory the run held: on CUDA the peak allocated on its device (torch's allocator,
    since the process started), elsewhere the process's peak resident set."""
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_initialized():
        return {
            "bytes": int(torch.cuda.max_memory_allocated(torch.device(device))),
            "kind": "cuda allocated",
            "device": device,
        }
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return {"bytes": None, "kind": "unmeasured", "device": device}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {
        "bytes": int(peak if sys.platform == "darwin" else peak * 1024),
        "kind": "process peak RSS",
        "device": device,
    }


def manifest(
    command: str, options: dict, device: str, extra: dict | None = None, inputs: list[dict] | None = None
) -> dict:
    """The manifest of a run. `inputs`: the recorded tables it was produced from (a baseline,
    calibration traces), each with the schema version it was read with."""
    # Versions from package metadata: a run that never loaded torch (calibrate on recorded runs)
    # is not made to import it (seconds) just to name it.
    from importlib.metadata import version

    torch = sys.modules.get("torch")
    return {
        "mgbench_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "options": options,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else version("torch"),
        "transformers": version("transformers"),
        "device": device,
        "device_name": device_name(device),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "peak_memory": peak_memory(device),
        "kernel_environment": kernel_environment(),
        "inputs": inputs or [],
        "git_revision": git_revision(),
        **(extra or {}),
    }


def looks_sharded(out: Path) -> bool:
    return (out / "shards").is_dir() or any(out.glob(".shard-*.partial"))


def prepare_out_dir(out: Path, sharded: bool = False) -> None:
    """Fail early (before any decoding) when the run directory cannot be published.

    A sharded run directory may already hold other shards' files."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    if out.exists() and any(out.iterdir()) and not (sharded and looks_sharded(out)):
        raise UserError(f"--out {out} already exists and is not empty; choose another directory or remove it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # A real write, not os.access: that answers yes to root on a read-only file system.
        probe = tempfile.NamedTemporaryFile(dir=out.parent, prefix=".mgbench-probe-")
        probe.close()
    except OSError as exc:
        raise UserError(
            f"--out {out}: cannot write in {out.parent} ({exc.strerror}); choose a writable directory"
        ) from exc


def publish_run(out: Path, tables: dict[str, pa.Table], documents: dict[str, dict], write_extra=None) -> Path:
    """Write tables (Parquet) and documents (JSON) into a staging folder, then rename it to `out`.

    `write_extra(staging_dir)` may add files (plots, report.md) before publication.
    """
    prepare_out_dir(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        for name, table in tables.items():
            pq.write_table(table, staging / f"{name}.parquet")
        for name, document in documents.items():
            (staging / f"{name}.json").write_text(json_text(document))
        if write_extra is not None:
            write_extra(staging)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def json_text(document: dict) -> str:
    """A run document as written to disk (numpy scalars and paths as plain JSON)."""
    return json.dumps(document, indent=2, default=json_default) + "\n"


def json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
