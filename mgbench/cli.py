"""The `mgbench` command line. The only place that turns errors into messages and exit codes."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .config import RunOptions, parse_batch_sizes
from .errors import UserError
from .models import DEFAULT_MODEL, REGISTRY

app = typer.Typer(
    help="Audit and benchmark batch-invariance of greedy LLM decoding (MarginGate).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
console = Console()
err_console = Console(stderr=True)


@contextmanager
def user_errors(debug: bool):
    """Bad input -> one line on stderr and exit code 2 (the traceback only with --debug)."""
    try:
        yield
    except UserError as exc:
        if debug:
            err_console.print_exception()
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted:[/] nothing was published")
        raise typer.Exit(130) from None


def default_out(command: str, model: str, dataset: str) -> Path:
    slug = lambda text: re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(text).name if Path(text).exists() else text)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{command}-{slug(model)}-{slug(dataset)}-{stamp}"


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=False,
    )


ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias (`mgbench models`), local folder or hub id.")
DatasetOpt = typer.Option("math500", "--dataset", "-d", help="Config name (`mgbench datasets`) or path to a .toml config.")
LimitOpt = typer.Option(None, "--limit", "-n", help="Decode a seeded sample of N requests (default: all).")
SeedOpt = typer.Option(0, "--seed", help="Seed of the --limit sample.")
BatchSizeOpt = typer.Option(8, "--batch-size", "-b", help="Batch size of the batched runs.")
BatchSizesOpt = typer.Option(None, "--batch-sizes", help="Sweep several batch sizes, e.g. 1,4,16 (overrides --batch-size).")
MaxNewOpt = typer.Option(None, "--max-new-tokens", help="Tokens to generate per request (default: the dataset's).")
PrefillOpt = typer.Option("alone", "--prefill", help="`alone`: prefill each request at batch size 1, batch the decode steps (as serving engines do); `batched`: one left-padded prefill.")
SortOpt = typer.Option(False, "--sort-by-length/--no-sort-by-length", help="Batch requests longest-first to shrink padding (default: arrival order).")
DtypeOpt = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32.")
DeviceOpt = typer.Option("auto", "--device", help="auto (cuda if available), cpu, cuda, cuda:N.")
AttnOpt = typer.Option("sdpa", "--attn", help="Attention implementation: sdpa or eager.")
OutOpt = typer.Option(None, "--out", "-o", help="Run directory (default: reports/COMMAND-MODEL-DATASET-TIME/).")
DebugOpt = typer.Option(False, "--debug", help="Show the traceback of an error.")


@app.command()
def flips(
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: Optional[int] = LimitOpt,
    seed: int = SeedOpt,
    batch_size: int = BatchSizeOpt,
    batch_sizes: Optional[str] = BatchSizesOpt,
    max_new_tokens: Optional[int] = MaxNewOpt,
    prefill: str = PrefillOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Audit flips: decode each request alone and inside batches, compare token by token.

    Teacher-forced batched decoding (fed the solo tokens) counts **flips** (batched argmax !=
    solo argmax) with their top-1/top-2 margins and K/V perturbation; free-running batched
    decoding measures sequence-level determinism. Writes steps.parquet, sequences.parquet,
    summary.json and manifest.json.

    Examples:

        mgbench flips --limit 8 --max-new-tokens 32

        mgbench flips --dataset gsm8k --limit 16 --batch-sizes 1,4,16 --out runs/gsm8k

        mgbench flips --model llama-3.1-8b --dataset math500 --batch-size 64 --device cuda
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes else (batch_size,)
        options = RunOptions(
            model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=sizes,
            max_new_tokens=max_new_tokens, prefill=prefill, sort_by_length=sort_by_length,
            dtype=dtype, device=device, attn=attn,
        )
        _run_flips(options, out or default_out("flips", model, dataset))


def load_with_status(options: RunOptions):
    from .models import load_model

    with err_console.status(f"loading {options.model}"):
        return load_model(options.model, options.dtype, options.device, options.attn)


def record_with_progress(lm, run, out: Path) -> dict:
    """One flips recording with progress bars for its solo and batched passes."""
    from .flips import record_flips

    with progress_bar() as progress:
        tasks = {
            "solo": progress.add_task(f"{run.config.name}: solo (batch size 1)", total=len(run.requests)),
            "batched": progress.add_task(f"{run.config.name}: batched (forced + free)",
                                         total=len(run.requests) * len(run.options.batch_sizes)),
        }
        return record_flips(lm, run, out, lambda phase, n: progress.advance(tasks[phase], n))


def _run_flips(options: RunOptions, out: Path) -> None:
    # Imported here so that `--help` and input errors answer without loading torch.
    import pandas as pd

    from . import analysis, report, results
    from .flips import prepare

    run = prepare(options)
    results.prepare_out_dir(out)
    lm = load_with_status(options)
    summary = record_with_progress(lm, run, out)
    sequences = pd.read_parquet(out / "sequences.parquet")
    report.render_flips(console, summary, analysis.batch_pad_lengths(sequences))
    console.print(f"results: [bold]{out}[/]")


@app.command()
def calibrate(
    runs: Optional[list[Path]] = typer.Argument(None, help="flips run directories to calibrate on (no model is loaded)."),
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(32, "--limit", "-n", help="Requests per recorded dataset."),
    seed: int = SeedOpt,
    batch_size: int = BatchSizeOpt,
    batch_sizes: Optional[str] = BatchSizesOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens per request when recording traces."),
    prefill: str = PrefillOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    safety: str = typer.Option("x1.5", "--safety", help="Widening of the minimal TAU: xF multiplies, +D adds (in the unit)."),
    unit: str = typer.Option("logit", "--unit", help="Margin unit written to calibration.json: logit (raw, as the paper) or ulp."),
    confidence: float = typer.Option(0.95, "--confidence", help="Level of the one-sided Clopper-Pearson bound on misses."),
    transfer: Optional[str] = typer.Option(None, "--transfer", help="Comma-separated datasets or run dirs to test the TAU on."),
    require_flips: bool = typer.Option(False, "--require-flips", help="Exit 1 when the traces hold no flip."),
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Calibrate the MarginGate threshold: the smallest TAU whose gate (margin < TAU) catches every flip.

    Traces come from flips run directories, or are recorded first with the same engine as
    `mgbench flips` (cached under $MGBENCH_CACHE/traces; an identical request reuses them).
    Reports TAU in raw logits and in BF16 ulps, the trigger rate each needs, recall and trigger
    rate on --transfer datasets, and a bound on the probability of a missed flip. Writes
    calibration.json (read by `verify --threshold-from`), curve.parquet, curve.png, margins.png.

    Examples:

        mgbench calibrate --dataset math500

        mgbench calibrate --dataset math500 --transfer gsm8k,humaneval,sharegpt

        mgbench calibrate runs/math500-b8 runs/math500-b16 --unit ulp --safety +1
    """
    with user_errors(debug):
        from .calibration import SafetyRule
        from .calibrate_run import CalibrateOptions

        sizes = parse_batch_sizes(batch_sizes) if batch_sizes else (batch_size,)
        record_options = RunOptions(
            model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=sizes, max_new_tokens=max_new_tokens,
            prefill=prefill, sort_by_length=sort_by_length, dtype=dtype, device=device, attn=attn,
        )
        options = CalibrateOptions(SafetyRule.parse(safety), unit, confidence)
        transfer_items = [item.strip() for item in (transfer or "").split(",") if item.strip()]
        target = out or default_out("calibrate", model, "+".join(str(r) for r in runs) if runs else dataset)
        code = _run_calibrate(list(runs or []), record_options, options, transfer_items, require_flips, target)
    raise typer.Exit(code)


def _run_calibrate(runs, record_options, options, transfer_items, require_flips, out) -> int:
    from dataclasses import asdict, replace

    import pandas as pd

    from . import calibrate_run, report, results
    from .flips import prepare

    results.prepare_out_dir(out)
    loaded = {}

    def record(opts: RunOptions, folder: Path) -> None:
        run = prepare(opts)
        if "lm" not in loaded:
            loaded["lm"] = load_with_status(opts)
        record_with_progress(loaded["lm"], run, folder)

    def traces(item: str):
        path = Path(item)
        if path.exists():
            return results.read_steps(path), str(path)
        steps, folder, reused = calibrate_run.traces_for(replace(record_options, dataset=item), record)
        err_console.print(f"{item}: {'reused cached' if reused else 'recorded'} traces in {folder}", highlight=False)
        return steps, folder

    if runs:
        tables = [traces(str(run)) for run in runs]
        steps = pd.concat([t for t, _ in tables], ignore_index=True)
        sources = [s for _, s in tables]
    else:
        steps, source = traces(record_options.dataset)
        sources = [source]
    transfer = {}
    for item in transfer_items:
        table, source = traces(item)
        transfer[Path(item).name if Path(item).exists() else item] = table
        sources.append(source)

    document, curves = calibrate_run.calibrate(steps, transfer, options, sources)
    device = loaded["lm"].device if "lm" in loaded else "cpu"
    manifest = results.manifest("calibrate", {"runs": [str(r) for r in runs], "record": asdict(record_options),
                                              "safety": str(options.safety), "unit": options.unit,
                                              "confidence": options.confidence, "transfer": transfer_items}, device)
    calibrate_run.publish(out, document, curves, steps, manifest)
    report.render_calibration(console, document)
    console.print(f"results: [bold]{out}[/]")
    if document["flips"] == 0:
        return 1 if require_flips else 0
    return 0


def read_calibration_threshold(path: Path, model: str) -> tuple[float, str]:
    """(TAU, unit) from a calibration.json, refused when it was made for another model."""
    import json

    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--threshold-from {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("kind") != "mgbench.calibration":
        raise UserError(f"--threshold-from {path}: not a calibration.json written by `mgbench calibrate`")
    if document.get("model") != model:
        raise UserError(f"--threshold-from {path}: calibrated for model {document.get('model')!r}, not {model!r}; "
                        "calibrate this model first")
    if document.get("tau") is None:
        raise UserError(f"--threshold-from {path}: the calibration saw no flips and holds no threshold")
    return float(document["tau"]), document.get("unit", "logit")


def policy_specs(policies: str, repairs: str, tau: float | None, unit: str):
    from .engine.policies import POLICIES, PolicySpec
    from .engine.verify import REPAIR_MODES

    kinds = [p.strip() for p in policies.split(",") if p.strip()]
    modes = [r.strip() for r in repairs.split(",") if r.strip()]
    for kind in kinds:
        if kind not in POLICIES:
            raise UserError(f"--policy {kind!r}: choose from {', '.join(POLICIES)}")
    for mode in modes:
        if mode not in REPAIR_MODES:
            raise UserError(f"--repair {mode!r}: choose from {', '.join(REPAIR_MODES)}")
    if not kinds or not modes:
        raise UserError("--policy and --repair need at least one value each")
    if "margin" in kinds:
        if tau is None:
            raise UserError("--policy margin needs --threshold TAU or --threshold-from calibration.json")
        if not (tau == tau and 0 < tau < 1e6):
            raise UserError(f"threshold {tau}: use a finite margin above 0 (a logit or ulp margin, e.g. 0.5)")
    specs = []
    for kind in kinds:
        for mode in (modes if kind != "none" else ["exact"]):
            specs.append(PolicySpec(kind, mode, tau if kind == "margin" else None, unit))
    return specs


@app.command()
def verify(
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(16, "--limit", "-n", help="Requests to verify (a seeded sample)."),
    seed: int = SeedOpt,
    batch_sizes: str = typer.Option("8", "--batch-sizes", "-b", help="Batch sizes, all of which must hold, e.g. 1,3,8,16."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per request."),
    policy: str = typer.Option("margin", "--policy", help="none, always, margin, oracle; a comma list runs each."),
    repair: str = typer.Option("exact", "--repair", help="exact (solo-exact reference, the default) or column (the paper's); a comma list runs each."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="TAU of the margin policy."),
    threshold_from: Optional[Path] = typer.Option(None, "--threshold-from", help="calibration.json from `mgbench calibrate` (TAU and unit)."),
    threshold_unit: str = typer.Option("logit", "--threshold-unit", help="Unit of --threshold: logit or ulp."),
    needle: bool = typer.Option(False, "--needle", help="Place each request at a random row among filler requests."),
    require_determinism: Optional[float] = typer.Option(None, "--require-determinism", help="Exit 1 when any policy's sequence-level determinism is below this (e.g. 1.0)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML (one case per policy, dataset, batch size)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of tables."),
    prefill: str = PrefillOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Verify: decode in batches under a verification policy; every output must equal its solo reference.

    Free-running batched decoding with MarginGate (`--policy margin`), always-on (`always`), the
    oracle floor (`oracle`) or none, each with `--repair exact` (a solo-exact reference: 100% by
    construction on verified steps) or `--repair column` (the paper's current-column repair).
    Exit codes: 0 ok, 1 determinism below --require-determinism, 2 bad input.

    Examples:

        mgbench verify --dataset math500 --threshold-from calibration.json --batch-sizes 4,8,16 --require-determinism 1.0

        mgbench verify --policy none --require-determinism 1.0          # the negative control: fails

        mgbench verify --policy margin,always,oracle --repair column,exact --threshold 0.47 --json

        mgbench verify --needle --batch-sizes 16 --threshold 0.47 --junit verify.xml
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes)
        options = RunOptions(
            model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=sizes, max_new_tokens=max_new_tokens,
            prefill=prefill, sort_by_length=sort_by_length, dtype=dtype, device=device, attn=attn,
        )
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        if threshold_unit not in ("logit", "ulp"):
            raise UserError(f"--threshold-unit {threshold_unit!r}: choose logit or ulp")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        specs = policy_specs(policy, repair, tau, unit)
        if require_determinism is not None and not 0 <= require_determinism <= 1:
            raise UserError(f"--require-determinism {require_determinism}: use a fraction in [0, 1]")
        code = _run_verify(options, specs, needle, require_determinism, junit, json_out,
                           out or default_out("verify", model, dataset))
    raise typer.Exit(code)


def _run_verify(options, specs, needle, required, junit, json_out, out) -> int:
    import json
    from dataclasses import asdict

    from . import analysis, report, results, verify_run
    from .flips import prepare
    from .junit import junit_xml, write_junit

    run = prepare(options)
    results.prepare_out_dir(out)
    lm = load_with_status(options)
    rows = len(run.requests) * len(options.batch_sizes) * len(specs)
    with progress_bar() as progress:
        tasks = {"solo": progress.add_task("solo (batch size 1)", total=len(run.requests)),
                 "batched": progress.add_task(f"batched x {len(specs)} policies", total=rows)}
        records = verify_run.run_verify(lm, run, specs, needle, lambda phase, n: progress.advance(tasks[phase], n))
    steps, sequences = verify_run.steps_table(records), verify_run.sequences_table(records)
    summary = {
        "model": options.model, "dataset": run.config.name, "prefill": options.prefill, "needle": needle,
        "batch_sizes": list(options.batch_sizes), "max_new_tokens": run.max_new_tokens,
        "threshold": next((s.tau for s in specs if s.kind == "margin"), None),
        "threshold_unit": next((s.unit for s in specs if s.kind == "margin"), None),
        **analysis.summarize_verify(sequences.to_pandas(), records.seconds, records.shortfalls, required),
    }
    manifest = results.manifest("verify", {**asdict(options), "policies": [s.label for s in specs], "needle": needle,
                                            "require_determinism": required}, lm.device,
                                {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source})
    results.publish_run(out, {"steps": steps, "sequences": sequences}, {"summary": summary, "manifest": manifest})
    if junit is not None:
        write_junit(junit, junit_xml(sequences.to_pandas(), 1.0 if required is None else required))
    if json_out:
        print(json.dumps(summary, indent=2))
    else:
        report.render_verify(console, summary)
        console.print(f"results: [bold]{out}[/]")
    return 1 if summary["passed"] is False else 0


@app.command()
def compare(
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(32, "--limit", "-n", help="Requests (a seeded sample)."),
    seed: int = SeedOpt,
    batch_size: int = BatchSizeOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per request."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="TAU of MarginGate."),
    threshold_from: Optional[Path] = typer.Option(None, "--threshold-from", help="calibration.json from `mgbench calibrate`."),
    threshold_unit: str = typer.Option("logit", "--threshold-unit", help="Unit of --threshold: logit or ulp."),
    repeats: int = typer.Option(3, "--repeats", help="Timed repeats after one warm-up pass (median and spread reported)."),
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Compare MarginGate with always-on verification, the oracle floor, batch-invariant attention and solo decoding.

    Same prompts, same batches, one process, after a warm-up pass: wall time of the decode
    steps, tokens/s, latency increment over plain batched decoding, trigger rate, repairs and
    sequence-level determinism for each configuration; the increment reduction always/MarginGate
    per repair mode; the gate's own cost; where verification time goes. Writes compare.parquet,
    summary.json, latency_increment.png and determinism_vs_triggers.png.

    Examples:

        mgbench compare --dataset math500 --limit 32 --batch-size 8 --threshold-from calibration.json

        mgbench compare --model llama-3.1-8b --device cuda --batch-size 64 --limit 256 --threshold 0.5
    """
    with user_errors(debug):
        options = RunOptions(model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=(batch_size,),
                             max_new_tokens=max_new_tokens, prefill="alone", sort_by_length=sort_by_length,
                             dtype=dtype, device=device, attn=attn)
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        policy_specs("margin", "exact", tau, unit)  # validates the threshold
        if repeats < 1:
            raise UserError(f"--repeats must be at least 1 (got {repeats})")
        _run_compare(options, tau, unit, repeats, out or default_out("compare", model, dataset))


def _run_compare(options, tau, unit, repeats, out) -> None:
    from dataclasses import asdict

    import pyarrow as pa

    from . import SCHEMA_VERSION, analysis, compare_run, plots, report, results
    from .flips import prepare

    run = prepare(options)
    results.prepare_out_dir(out)
    lm = load_with_status(options)
    configs = len(compare_run.configurations(tau, unit))
    with progress_bar() as progress:
        tasks = {"solo": progress.add_task("solo references", total=len(run.requests)),
                 "warmup": progress.add_task("warm-up", total=1),
                 "configs": progress.add_task(f"{configs} configs x {repeats} repeats", total=configs * repeats)}
        runs, extra = compare_run.run_compare(lm, run, tau, unit, options.batch_sizes[0], repeats,
                                              lambda phase, n: progress.advance(tasks[phase], n))
    table = analysis.compare_table(runs)
    clean = lambda v: None if isinstance(v, float) and v != v else v  # NaN -> null in JSON
    summary = {
        "model": options.model, "dataset": run.config.name, "batch_size": options.batch_sizes[0],
        "sequences": len(run.requests), "max_new_tokens": run.max_new_tokens, "repeats": repeats,
        "threshold": tau, "threshold_unit": unit, **extra,
        "configs": [{k: clean(v) for k, v in row.items()} for row in table.to_dict("records")],
        "reductions": [analysis.reductions(runs, repair) for repair in ("column", "exact")],
        "breakdown": [{k: clean(v) for k, v in row.items()}
                      for row in runs[runs["repeat"] == 0][["config", *[f"t_{b}" for b in compare_run.BREAKDOWN]]]
                      .dropna(subset=["t_gate"]).to_dict("records")],
    }
    manifest = results.manifest("compare", {**asdict(options), "threshold": tau, "threshold_unit": unit,
                                            "repeats": repeats}, lm.device,
                                {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source})
    compare_table = pa.Table.from_pandas(runs, preserve_index=False)
    compare_table = compare_table.replace_schema_metadata({results.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    results.publish_run(out, {"compare": compare_table}, {"summary": summary, "manifest": manifest},
                        lambda staging: plots.compare_plots(table, staging))
    report.render_compare(console, summary)
    console.print(f"results: [bold]{out}[/]")


@app.command("report")
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run directories of flips, calibrate, verify or compare."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for report.md and its plots (default: reports/report-TIME/)."),
    debug: bool = DebugOpt,
) -> None:
    """Render report.md with tables and plots from run directories, also ones recorded on another machine.

    Examples:

        mgbench report reports/flips-smollm2-135m-math500-20261202-120000

        mgbench report runs/calibrate runs/verify runs/compare --out docs/results
    """
    with user_errors(debug):
        from .report_md import render

        target = out or Path("reports") / f"report-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        path = render(list(runs), target)
    console.print(f"report: [bold]{path}[/]")


@app.command()
def models() -> None:
    """List the model aliases (any local folder or hub id in the local cache works too)."""
    table = Table(title="models")
    for column in ("alias", "hub id", "notes"):
        table.add_column(column)
    for spec in REGISTRY.values():
        table.add_row(spec.alias + (" (default)" if spec.alias == DEFAULT_MODEL else ""), spec.hub_id, spec.description)
    console.print(table)


@app.command()
def datasets(debug: bool = DebugOpt) -> None:
    """List the dataset configs under datasets_cfg/ (pass a .toml path for your own)."""
    from .data import config_paths, load_config

    with user_errors(debug):
        table = Table(title="datasets")
        for column in ("name", "source", "prompt field", "chat template", "max new tokens", "description"):
            table.add_column(column)
        for name in config_paths():
            config = load_config(name)
            table.add_row(name, f"{config.kind}: {config.location}", config.prompt_field,
                          str(config.chat_template), str(config.max_new_tokens), config.description)
        console.print(table)


def main() -> None:  # pragma: no cover - `python -m mgbench`
    app(prog_name="mgbench")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
