"""Every mgbench command once on one GPU, with one table of what each measured.

Runs, each as a subprocess of the `mgbench` CLI of this Python environment, on --device:
flips (a batch-size sweep), calibrate (over that flips run), verify (MarginGate at the calibrated
threshold), compare (small, one timed repeat), probe, and flips again with --kernels fixed-order
and with --batch-invariant, and fixed-order flips at batch 64 (the plan's forms and tile size T:
a GPU GEMM picks its kernel by the row count); with --also ALIAS, flips on that model too when its weights are in
the local cache. Each run writes its run directory under --out; the table (command, exit code,
wall time, peak memory, key figures) is printed and written to OUT/gpu_check.md.

Settings: flips 16 math500 requests x 64 tokens at batch sizes 1,8,16 (verify 8,16); compare 16
requests at batch 8, 32 tokens, one timed repeat, every configuration; probe 16 rows; fixed-order
64 requests x 24 tokens at batch 64. --quick: 4 requests x 8 tokens at 1,2 (verify 2), compare
only `none` and always-on, probe 2 rows, fixed-order 4 x 4 at batch 4.

Exit 0 when every command exited 0; 1 otherwise (the failing commands are named); 2 when CUDA is
not available (pass --device cpu to run the same sequence on the CPU).

    python examples/gpu_check.py
    python examples/gpu_check.py --also llama-3.1-8b --out reports/gpu-check
    python examples/gpu_check.py --device cpu --quick     # a smoke test without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

# Run from a checkout: this script, its mgbench imports and the mgbench commands it starts
# (`python -m mgbench`, in the checkout's root) all use the checkout's code.
REPO = Path(__file__).resolve().parents[1]
CHECKOUT = REPO if (REPO / "mgbench" / "__init__.py").is_file() else None
if CHECKOUT is not None and str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))


FALLBACK_TAU = 0.5  # verify and compare need a threshold when the calibration saw no flip


@dataclass(frozen=True)
class Settings:
    limit: int
    batch_sizes: str  # flips sweep
    verify_batch_sizes: str
    max_new_tokens: int
    compare_limit: int
    compare_batch_size: int
    compare_max_new_tokens: int
    probe_rows: int
    compare_only: str | None  # compare's --only (every configuration when None)
    large_batch: int  # fixed-order flips at this batch size, as many requests (a GPU GEMM picks its kernel by M)
    large_tokens: int


FULL = Settings(16, "1,8,16", "8,16", 64, 16, 8, 32, 16, None, 64, 24)
# A smoke test: compare times only `none` and always-on verification (its fixed-order, replay
# and batch-invariant configurations each probe the model first: minutes on 2 CPU cores).
QUICK = Settings(4, "1,2", "2", 8, 4, 2, 8, 2, "always", 4, 4)


@dataclass
class Step:
    name: str  # what the table calls it
    command: str  # the mgbench subcommand
    args: list[str]
    out: Path | None  # its run directory
    summarize: object = None  # run directory -> key figures (str)
    code: int | None = None
    wall_s: float | None = None
    rss_bytes: int | None = None
    figures: str = ""
    note: str = ""
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python examples/gpu_check.py --also llama-3.1-8b   "
        "(smoke test without a GPU: python examples/gpu_check.py --device cpu --quick)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument(
        "--model", default="smollm2-135m", help="model alias, local folder or hub id (default smollm2-135m)"
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="ALIAS",
        help="also run flips on this model when its weights are in the local cache (repeatable)",
    )
    parser.add_argument("--dataset", default="math500", help="dataset of every run (default math500)")
    parser.add_argument("--out", type=Path, help="folder for the run directories (default reports/gpu-check-TIME)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny settings (a smoke test): 4 requests, batch sizes 1,2, 8 tokens, compare --only always",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one command may take (default 900)")
    return parser.parse_args(argv)


# --- the environment --------------------------------------------------------------------------


def mgbench_command() -> list[str]:
    """The mgbench CLI run by this very interpreter (its console script may name another one)."""
    return [sys.executable, "-m", "mgbench"]


def header_lines(device: str) -> list[str]:
    import torch

    from mgbench import __version__
    from mgbench.runs.machine import cpu_name
    from mgbench.runs.rundir import code_revision

    lines = []
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        lines.append(f"GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} visible")
    lines.append(
        f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, "
        f"cuDNN {torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}, "
        f"python {platform.python_version()}"
    )
    lines.append(f"CPU: {cpu_name()} ({os.cpu_count()} cores)")
    lines.append(f"mgbench {__version__} (git {code_revision()}): {shlex.join(mgbench_command())}")
    return lines


def cached_model(name: str) -> str | None:
    """None when the model's weights can be read offline, else why not (one line)."""
    from mgbench.assets import models
    from mgbench.errors import UserError

    try:
        source = models.resolve_source(name)  # a packaged alias is converted here, offline
    except UserError as exc:
        return str(exc)
    if Path(source).is_dir():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return "huggingface_hub is not installed"
    config = try_to_load_from_cache(source, "config.json")
    if not isinstance(config, str):
        return f"{source} is not in the local hub cache (download it first: `hf download {source}`)"
    snapshot = Path(config).parent
    if not any(snapshot.glob("*.safetensors")) and not any(snapshot.glob("*.bin")):
        return f"{source}: config cached but no weights in {snapshot} (download it first: `hf download {source}`)"
    return None


# --- running one command ----------------------------------------------------------------------


def run_step(step: Step, timeout: float, logs: Path) -> None:
    """Run one mgbench command; its exit code, wall time, peak RSS (os.wait4, this child only)."""
    command = [*mgbench_command(), step.command, *step.args]
    print(f"$ {shlex.join(['mgbench', step.command, *step.args])}", flush=True)
    stdout_path, stderr_path = logs / f"{slug(step.name)}.stdout", logs / f"{slug(step.name)}.stderr"
    start = time.perf_counter()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, cwd=CHECKOUT)
    deadline = start + timeout
    timed_out = False
    try:
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid == process.pid:
                break
            if time.perf_counter() > deadline:
                os.kill(process.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(process.pid, 0)
                timed_out = True
                break
            time.sleep(0.1)
    except KeyboardInterrupt:  # Ctrl-C: the child goes too
        os.kill(process.pid, signal.SIGKILL)
        os.wait4(process.pid, 0)
        process.returncode = -signal.SIGKILL
        raise
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4
    step.wall_s = time.perf_counter() - start
    step.rss_bytes = usage.ru_maxrss * 1024
    step.code = 124 if timed_out else process.returncode
    if timed_out:
        step.note = f"timed out after {timeout:.0f} s"
    step.stderr_tail = tail(stderr_path)
    if step.code == 0 and step.summarize is not None and step.out is not None:
        try:
            step.figures = step.summarize(step.out)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            step.figures = f"cannot read the run's results: {exc}"
    print(f"  exit {step.code}, {step.wall_s:.1f} s", flush=True)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def peak_memory(step: Step) -> str:
    """The manifest's peak_memory when the run records one, else the child's peak RSS."""
    if step.out is not None:
        try:
            peak = read_json(step.out / "manifest.json").get("peak_memory")
        except (OSError, ValueError):
            peak = None
        if isinstance(peak, dict) and peak.get("bytes") is not None:
            return f"{peak['bytes'] / 2**20:,.0f} MB ({peak.get('kind', '?')}, {peak.get('device', '?')})"
    return f"{step.rss_bytes / 2**20:,.0f} MB (RSS)" if step.rss_bytes else "-"


# --- key figures of each command's run directory ---------------------------------------------


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def signed_pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def flips_figures(run: Path) -> str:
    s = read_json(run / "summary.json")
    parts = [
        f"flip rate {pct(s['flip_rate'])} ({s['flips']}/{s['steps']})",
        f"identical {pct(s['determinism'])} ({s['sequences'] - s['sequences_diverged']}/{s['sequences']})",
    ]
    by_size = s.get("by_batch_size") or []
    if len(by_size) > 1:
        largest = max(by_size, key=lambda row: row["batch_size"])
        parts.append(f"at batch {largest['batch_size']}: identical {pct(largest['determinism'])}")
    parts.append(f"against {s.get('reference', 'stock solo')}")
    if s.get("batched_tokens_per_s"):
        parts.append(f"{s['batched_tokens_per_s']:.3g} tok/s batched")
    return "; ".join(parts)


def fixed_order_figures(run: Path) -> str:
    """flips' figures, then the fixed-order plan: the forms and the tile size T the probe chose."""
    plan = read_json(run / "summary.json")["fixed_order"]["plan"]
    forms = ", ".join(f"{n} {form}" for form, n in plan["modules"].items()) or "every module as is"
    return f"{flips_figures(run)}; plan: {forms}, T = {plan.get('tile_rows') or '-'}"


def calibrate_figures(run: Path) -> str:
    c = read_json(run / "calibration.json")
    if c.get("tau") is None:
        return f"no flips in {c.get('steps')} steps: no threshold (verify/compare use TAU {FALLBACK_TAU})"
    return (
        f"TAU {c['tau']:.4g} {c['unit']}; trigger rate {pct(c['trigger_rate'])} "
        f"(oracle {pct(c['oracle_trigger_rate'])}); {c['flips']} flips / {c['steps']} steps"
    )


def verify_figures(run: Path) -> str:
    s = read_json(run / "summary.json")
    return "; ".join(
        f"{p['policy']}: determinism {pct(p['determinism'])}, trigger rate {pct(p['trigger_rate'])}, "
        f"{p['repairs']} repairs"
        for p in s["policies"]
    )


def compare_figures(run: Path) -> str:
    s = read_json(run / "summary.json")
    configs = {row["config"]: row for row in s["configs"]}
    parts = []
    for name, row in configs.items():
        if name == "none" or not (
            name.startswith(("margin", "always"))
            and name.endswith("/exact")
            or name in ("batch-invariant", "fixed-order kernels")
        ):
            continue
        reference = row.get("reference") or "stock solo"
        against = "" if reference == "stock solo" else f" against {reference}"
        parts.append(f"{name}: {signed_pct(row.get('increment'))}, det {pct(row.get('determinism'))}{against}")
    reduction = next((r for r in s.get("reductions", []) if r.get("repair") == "exact"), None)
    if reduction and reduction.get("median") is not None:
        parts.append(f"always/margin increment ratio {reduction['median']:.2f}x")
    return "; ".join(parts) + " (latency increment over plain batched)"


def probe_figures(run: Path) -> str:
    p = read_json(run / "probe.json")
    findings = p.get("findings", [])
    varying = sum(1 for f in findings if not f.get("invariant", True))
    return (
        f"{varying}/{len(findings)} ops vary; plain step rows differing {len(p['plain_rows_differing'])}/{p['rows']}; "
        f"batch-invariant exact {'yes' if p['batch_invariant_exact'] else 'NO'}, "
        f"step increment {signed_pct(p.get('invariant_step_increment'))}"
    )


# --- the sequence ------------------------------------------------------------------------------


def plan(args, out: Path, settings: Settings) -> list[Step]:
    device = ["--device", args.device]
    common = ["--model", args.model, "--dataset", args.dataset, *device]
    sweep = ["--limit", str(settings.limit), "--max-new-tokens", str(settings.max_new_tokens)]
    steps = [
        Step(
            "flips",
            "flips",
            [*common, *sweep, "--batch-sizes", settings.batch_sizes, "--out", str(out / "flips")],
            out / "flips",
            flips_figures,
        ),
        Step(
            "calibrate",
            "calibrate",
            [str(out / "flips"), "--out", str(out / "calibrate")],
            out / "calibrate",
            calibrate_figures,
        ),
        Step(
            "verify",
            "verify",
            [*common, *sweep, "--batch-sizes", settings.verify_batch_sizes, "--out", str(out / "verify")],
            out / "verify",
            verify_figures,
        ),
        Step(
            "compare",
            "compare",
            [
                *common,
                *("--limit", str(settings.compare_limit), "--batch-size", str(settings.compare_batch_size)),
                *("--max-new-tokens", str(settings.compare_max_new_tokens), "--repeats", "1"),
                *(["--only", settings.compare_only] if settings.compare_only else []),
                *("--out", str(out / "compare")),
            ],
            out / "compare",
            compare_figures,
        ),
        Step(
            "probe",
            "probe",
            [*common, "--rows", str(settings.probe_rows), "--out", str(out / "probe")],
            out / "probe",
            probe_figures,
        ),
    ]
    for name, flag in (
        ("flips --kernels fixed-order", ["--kernels", "fixed-order"]),
        ("flips --batch-invariant", ["--batch-invariant"]),
    ):
        folder = out / slug(name)
        steps.append(
            Step(
                name,
                "flips",
                [*common, *sweep, "--batch-sizes", settings.batch_sizes, *flag, "--out", str(folder)],
                folder,
                flips_figures,
            )
        )
    folder = out / "flips-fixed-order-large-batch"
    large = ["--limit", str(settings.large_batch), "--max-new-tokens", str(settings.large_tokens)]
    steps.append(
        Step(
            "flips --kernels fixed-order, large batch",
            "flips",
            [
                *common,
                *large,
                "--batch-size",
                str(settings.large_batch),
                "--kernels",
                "fixed-order",
                "--out",
                str(folder),
            ],
            folder,
            fixed_order_figures,
        )
    )
    for alias in args.also:
        folder = out / slug(f"flips-{alias}")
        also = ["--model", alias, "--dataset", args.dataset, *device, *sweep, "--batch-sizes", settings.batch_sizes]
        step = Step(f"flips --model {alias}", "flips", [*also, "--out", str(folder)], folder, flips_figures)
        reason = cached_model(alias)
        if reason is not None:
            step.note = f"skipped: {reason}"
        steps.append(step)
    return steps


def threshold_args(calibration: Path) -> tuple[list[str], str]:
    """verify/compare's threshold options from the calibration: --threshold-from, or the fallback
    TAU when the calibration holds none (it saw no flip)."""
    try:
        tau = read_json(calibration).get("tau")
    except (OSError, ValueError):
        tau = None
    if tau is None:
        return ["--threshold", str(FALLBACK_TAU)], f"TAU {FALLBACK_TAU} (calibration held none)"
    return ["--threshold-from", str(calibration)], ""


def run_all(steps: list[Step], out: Path, timeout: float) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    by_name = {step.name: step for step in steps}
    for step in steps:
        if step.note.startswith("skipped"):
            print(f"- {step.name}: {step.note}", flush=True)
            continue
        if step.name in ("verify", "compare"):
            calibrate = by_name["calibrate"]
            if calibrate.code != 0:
                step.note = "skipped: calibrate failed"
                step.code = None
                continue
            extra, note = threshold_args(calibrate.out / "calibration.json")
            step.args = [*step.args, *extra]
            step.note = note
        if step.name == "calibrate":
            if by_name["flips"].code != 0:
                step.note = "skipped: flips failed"
                continue
        run_step(step, timeout, logs)


def failed(step: Step) -> bool:
    """A command that did not exit 0; an --also model that is not cached is skipped, not failed."""
    if step.code is None:
        return not step.name.startswith("flips --model ")
    return step.code != 0


def table_rows(steps: list[Step]) -> list[list[str]]:
    rows = []
    for step in steps:
        if step.code is None:
            status = "skipped"
        else:
            status = "ok" if step.code == 0 else f"exit {step.code}"
        figures = step.figures if step.code == 0 else (step.stderr_tail.splitlines()[-1:] or [""])[0]
        if step.note:
            figures = f"{figures} [{step.note}]" if figures else step.note
        rows.append(
            [
                step.name,
                status,
                "-" if step.wall_s is None else f"{step.wall_s:.1f}",
                "-" if step.code is None else peak_memory(step),
                figures,
            ]
        )
    return rows


COLUMNS = ["command", "status", "wall s", "peak memory", "key figures"]


def print_table(rows: list[list[str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for column in COLUMNS:
        table.add_column(column, justify="right" if column == "wall s" else "left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console(width=max(160, Console().width)).print(table)


def markdown(rows: list[list[str]], header: list[str], command_line: str) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [f"- {line}" for line in header] + [f"- command: `{command_line}`", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device}: CUDA is not available on this machine "
            "(pass --device cpu to run the same checks on the CPU)",
            file=sys.stderr,
        )
        return 2
    from mgbench.assets import models
    from mgbench.errors import UserError

    for alias in args.also:
        if alias in models.REGISTRY or Path(alias).expanduser().is_dir():
            continue
        try:
            models.resolve_source(alias)
        except UserError as exc:
            print(f"gpu_check: --also {alias}: {exc}", file=sys.stderr)
            return 2
    out = (args.out or Path("reports") / f"gpu-check-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if out.exists() and any(out.iterdir()):
        print(f"gpu_check: --out {out} is not empty; give a new folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    header = header_lines(args.device)
    command_line = shlex.join([Path(sys.executable).name, *sys.argv])
    for line in header:
        print(line)
    settings = QUICK if args.quick else FULL
    steps = plan(args, out, settings)
    start = time.perf_counter()
    run_all(steps, out, args.timeout)
    total = time.perf_counter() - start
    rows = table_rows(steps)
    title = f"mgbench gpu check: {args.model} on {args.device} ({'quick' if args.quick else 'full'}), {total:.0f} s"
    print_table(rows, title)
    document = f"## {title}\n\n" + markdown(rows, header, command_line)
    (out / "gpu_check.md").write_text(document)
    print(f"table: {out / 'gpu_check.md'}; run directories and logs under {out}")
    bad = [step for step in steps if failed(step)]
    for step in bad:
        reason = step.note or f"exit {step.code}"
        print(f"FAILED: {step.name} ({reason})", file=sys.stderr)
        if step.stderr_tail:
            print("  " + step.stderr_tail.replace("\n", "\n  "), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
