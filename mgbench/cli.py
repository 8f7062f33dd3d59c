"""The `mgbench` command line. The only place that turns errors into messages and exit codes."""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
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


def log_width(stream) -> int | None:
    """Full width where output goes to a file or a CI log (no cut columns, no ellipses): rich's
    80-column default applies only when the stream is not a terminal and COLUMNS is unset."""
    if "COLUMNS" in os.environ or stream.isatty():
        return None
    return 10_000


console = Console(width=log_width(sys.stdout))
err_console = Console(stderr=True, width=log_width(sys.stderr))


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
        err_console.print("[bold red]interrupted:[/] nothing was published (flips and verify keep their finished "
                          "groups: the same command with --resume continues)")
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
ShardOpt = typer.Option(None, "--shard", help="Decode shard I of N (I/N, from 0) into a shared --out; under torchrun RANK/WORLD_SIZE set it.")
ResumeOpt = typer.Option(False, "--resume", help="Continue an interrupted run in --out from its last finished group of requests.")
TpPlanOpt = typer.Option(None, "--tp-plan", help="`auto`: split the model over the torchrun processes (transformers tensor parallelism).")
JsonOpt = typer.Option(False, "--json", help="Print the summary as JSON on stdout (nothing else goes to stdout).")
BaselineOpt = typer.Option(None, "--baseline", help="A recorded run of the same audit: exit 1 when flips or divergences rose beyond chance (paired one-sided exact test).")
AlphaOpt = typer.Option(0.01, "--alpha", help="Significance level of the --baseline test.")
BatchInvariantOpt = typer.Option(False, "--batch-invariant", help="Decode batches with every op that varies on this machine made invariant (measured by `mgbench probe` first; per-row attention, exact forms of varying layers).")


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
    shard: Optional[str] = ShardOpt,
    resume: bool = ResumeOpt,
    tp_plan: Optional[str] = TpPlanOpt,
    batch_invariant: bool = BatchInvariantOpt,
    require_determinism: Optional[float] = typer.Option(None, "--require-determinism", help="Exit 1 when the share of sequences equal to solo is below this (e.g. 1.0)."),
    max_flip_rate: Optional[float] = typer.Option(None, "--max-flip-rate", help="Exit 1 when flips / teacher-forced steps is above this (e.g. 0.01)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML: one case per dataset and batch size, and the baseline test."),
    baseline: Optional[Path] = BaselineOpt,
    alpha: float = AlphaOpt,
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="Audit an OpenAI-compatible server at this base URL (e.g. http://127.0.0.1:8000/v1) instead of the in-process engine; --model then names the tokenizer."),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="--endpoint: the model name the server knows (default: the one /v1/models lists)."),
    top_logprobs: Optional[int] = typer.Option(None, "--top-logprobs", help="--endpoint: top-k logprobs asked per token (margins, drift); default 5."),
    request_timeout: Optional[float] = typer.Option(None, "--request-timeout", help="--endpoint: seconds to wait for one completion; default 300."),
    needle: bool = typer.Option(False, "--needle", help="--endpoint: send each audited request among B-1 filler requests."),
    label: Optional[str] = typer.Option(None, "--label", help="The engine's name in reports (e.g. 'vLLM eager'); default: the server and its version, or in-process."),
    json_out: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Audit flips: decode each request alone and inside batches, compare token by token.

    Teacher-forced batched decoding (fed the solo tokens) counts **flips** (batched argmax !=
    solo argmax) with their top-1/top-2 margins and K/V perturbation; free-running batched
    decoding measures sequence-level determinism. With --endpoint, a served model is audited as
    a black box: solo, concurrent batches, solo again; steps up to the first divergence, margins
    and drift from top-k logprobs. Writes steps.parquet, sequences.parquet,
    summary.json and manifest.json. Exit codes: 0 ok, 1 a --require-determinism,
    --max-flip-rate or --baseline check failed, 2 bad input.

    Examples:

        mgbench flips --limit 8 --max-new-tokens 32

        mgbench flips --dataset gsm8k --limit 16 --batch-sizes 1,4,16

        mgbench flips --model llama-3.1-8b --batch-size 64 --device cuda

        # continue after a crash

        mgbench flips --limit 64 --out runs/m --resume

        # expect 0 flips

        mgbench flips --batch-invariant --limit 16 --max-new-tokens 32

        # record a baseline, then gate later runs on it

        mgbench flips --limit 16 --out runs/base

        mgbench flips --limit 16 --baseline runs/base --junit flips.xml

        torchrun --nproc-per-node 8 -m mgbench flips --model llama-3.1-8b \\
            --limit 512 --out runs/m8

        # a served model (vLLM, SGLang, TGI): same prompts, as token ids

        mgbench flips --endpoint http://127.0.0.1:8000/v1 --limit 32 \\
            --batch-size 8 --max-new-tokens 64 --label "vLLM eager"
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes else (batch_size,)
        endpoint_options = endpoint_flips_options(
            endpoint, served_model, top_logprobs, request_timeout, needle, label,
            {"--prefill": prefill != "alone" and f"--prefill {prefill}", "--dtype": dtype != "bf16" and f"--dtype {dtype}",
             "--device": device != "auto" and f"--device {device}", "--attn": attn != "sdpa" and f"--attn {attn}",
             "--tp-plan": tp_plan is not None and "--tp-plan", "--batch-invariant": batch_invariant and "--batch-invariant",
             "--shard": shard is not None and "--shard"})
        options = RunOptions(
            model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=sizes,
            max_new_tokens=max_new_tokens, prefill=prefill, sort_by_length=sort_by_length,
            dtype=dtype, device=rank_device(device), attn=attn, tp_plan=tp_plan, batch_invariant=batch_invariant,
        )
        from .gate import GateSpec, Thresholds

        spec = GateSpec(Thresholds(require_determinism, max_flip_rate), baseline, alpha)
        placement = Placement.resolve(shard, resume, tp_plan, out)
        code = _run_flips(options, placement, out or default_out("flips", model, dataset), spec, junit, json_out,
                          endpoint_options, label)
    raise typer.Exit(code)


# Why each in-process option cannot apply to a black box.
BLACK_BOX_REASONS = {
    "--prefill": "the server schedules its own prefill",
    "--dtype": "the server decodes in the dtype it was started with",
    "--device": "the server decodes on its own device",
    "--attn": "the server picks its own attention kernels",
    "--tp-plan": "the server shards the model itself",
    "--batch-invariant": "it patches the in-process model (a server has its own switch, e.g. VLLM_BATCH_INVARIANT=1)",
    "--shard": "one client audits a server; several would change the concurrency it sees",
}


def endpoint_flips_options(endpoint, served_model, top_logprobs, request_timeout, needle, label, in_process: dict):
    """EndpointOptions for --endpoint (None without it); the in-process options given
    (`in_process`: option -> the text given, or False) refused with the reason."""
    from .endpoint.client import EndpointOptions

    if endpoint is None:
        given = [name for name, value in (("--served-model", served_model), ("--top-logprobs", top_logprobs),
                                          ("--request-timeout", request_timeout), ("--needle", needle or None))
                 if value is not None]
        if given:
            extra = " (in-process needle batches: `mgbench verify --needle`)" if "--needle" in given else ""
            raise UserError(f"{', '.join(given)} only apply with --endpoint URL{extra}")
        return None
    for option, given in in_process.items():
        if given:
            raise UserError(f"{given} cannot apply to --endpoint: {BLACK_BOX_REASONS[option]}")
    given = {"top_logprobs": top_logprobs, "request_timeout": request_timeout}  # None: EndpointOptions' default
    return EndpointOptions(endpoint, served_model, needle=needle, label=label,
                           **{name: value for name, value in given.items() if value is not None})


def rank_device(device: str) -> str:
    """Under torchrun each process takes the GPU of its LOCAL_RANK."""
    from .sharding import torchrun_rank

    launched = torchrun_rank()
    if launched is None or device not in ("auto", "cuda"):
        return device
    import torch

    return f"cuda:{launched[2]}" if torch.cuda.is_available() else device


@dataclass(frozen=True)
class Placement:
    """Which shard this process decodes, whether it resumes, and whether it writes at all."""

    shard: object
    resume: bool
    writes: bool  # False on tensor-parallel ranks other than 0: they compute, rank 0 publishes

    @classmethod
    def resolve(cls, shard_text: str | None, resume: bool, tp_plan: str | None, out: Path | None) -> "Placement":
        from .sharding import resolve_shard, torchrun_rank

        shard = resolve_shard(shard_text, tensor_parallel=tp_plan is not None)
        if out is None and (shard.sharded or resume):
            raise UserError(("--resume" if resume else f"shard {shard}") + " needs --out: the run directory "
                            "to continue, shared by every shard")
        launched = torchrun_rank()
        return cls(shard, resume, not (tp_plan and launched and launched[0] != 0))


@contextmanager
def output_dir(placement: Placement, out: Path):
    """The run directory, or a throw-away one for a tensor-parallel rank that does not write."""
    if placement.writes:
        yield out
        return
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="mgbench-tp-rank-"))
    try:
        yield scratch / out.name
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_with_status(options: RunOptions):
    from .models import load_model

    with err_console.status(f"loading {options.model}"):
        return load_model(options.model, options.dtype, options.device, options.attn, options.tp_plan)


def warn_split(batch_size: int, half: int) -> None:
    err_console.print(f"[bold yellow]out of memory[/] at batch size {batch_size}: retrying it as batches of "
                      f"{half} (their rows record batch_size {half}; summary.json lists the split)", highlight=False)


@contextmanager
def pass_progress(solo_label: str, batched_label: str, requests: int, batches_per_request: int,
                  repeat_label: str | None = None):
    """Bars for the solo, the batched and (an endpoint's) solo-repeat passes; yields the
    ProgressFn that drives them."""
    with progress_bar() as progress:
        per_request = {"solo": 1, "batched": batches_per_request, **({"solo-repeat": 1} if repeat_label else {})}
        labels = {"solo": solo_label, "batched": batched_label, "solo-repeat": repeat_label}
        tasks = {phase: progress.add_task(labels[phase], total=requests * k) for phase, k in per_request.items()}

        def advance(phase: str, n: int) -> None:
            if phase == "total":  # what is left to decode (this shard, groups not yet committed)
                for name, k in per_request.items():
                    progress.update(tasks[name], total=n * k)
            else:
                progress.advance(tasks[phase], n)

        yield advance


def probe_if_invariant(lm, run):
    """The probe a --batch-invariant run plans with (None otherwise), said in one line."""
    if lm is None or not run.options.batch_invariant:
        return None
    from .probe_run import probe_for_run, probe_rows

    with err_console.status(f"probing which ops vary on this machine ({probe_rows(max(run.options.batch_sizes))} rows)"):
        report = probe_for_run(lm, run)
    changed = len(report.plan.forms)
    line = (f"batch-invariant mode: per-row attention, {changed} varying modules in exact forms "
            f"(probe: {report.machine['cpu']}, {report.machine['cpu_capability']})")
    if report.exact:
        err_console.print(f"[green]{line}; exact on the probe batch[/]", highlight=False)
    else:
        err_console.print(f"[bold yellow]{line}; NOT exact on the probe batch (rows "
                          f"{report.invariant_rows_differing} differ from solo): the run measures how far off[/]",
                          highlight=False)
    return report


def in_process_engine(lm, run, label: str | None = None):
    """The in-process engine on a loaded model (None: a shard only finishing, nothing to decode)."""
    if lm is None:
        return None
    from .engines import InProcessEngine

    engine = InProcessEngine(lm, probe_if_invariant(lm, run))
    engine.label = label or engine.label
    return engine


def record_with_progress(engine, run, out: Path, writer=None) -> tuple[dict, bool]:
    """One flips recording with progress bars for its passes (an endpoint's solo repeat too)."""
    from .flips import record_flips

    name = run.config.name
    batched = "batched (concurrent)" if run.endpoint is not None else "batched (forced + free)"
    with pass_progress(f"{name}: solo (batch size 1)", f"{name}: {batched}", len(run.requests),
                       len(run.options.batch_sizes),
                       f"{name}: solo again" if run.endpoint is not None else None) as advance:
        return record_flips(engine, run, out, advance, warn_split, writer)


def shard_status(placement: Placement, out: Path, complete: bool) -> None:
    if not placement.shard.sharded:
        return
    from .results import missing_shards

    if complete:
        console.print(f"shard {placement.shard}: done; all shards are in: {out} is complete")
    else:
        console.print(f"shard {placement.shard}: done; waiting for shard {', '.join(missing_shards(out))}")


def attach_gate(run, spec, command: str, extra_identity: dict | None = None):
    """Load and check the baseline (before any model is loaded) and let the run's summary carry the
    gate's verdict. Returns the baseline (or None)."""
    from dataclasses import asdict

    from . import gate

    baseline = gate.load_baseline(spec.baseline, command) if spec.baseline is not None else None
    if baseline is not None:
        run.inputs.append({"role": "baseline", "path": str(baseline.path), "schema_version_read": baseline.schema_version})
        gate.check_baseline(baseline, gate.run_identity({**asdict(run.options), "max_new_tokens": run.max_new_tokens},
                                                        [r.request_id for r in run.requests], extra_identity))
    if spec.active:
        teacher_forced = command == "flips"  # verify's steps are free-running: its test is on sequences
        run.gate = lambda summary, tables: gate.evaluate(
            spec, summary, tables["steps"].to_pandas() if teacher_forced else None, tables["sequences"].to_pandas(),
            baseline, None if teacher_forced else ["policy"])
    return baseline


def finish_output(out: Path, summary: dict, json_out: bool, render) -> None:
    """The run's report on the terminal, or its summary as JSON on stdout (then nothing else
    goes there); and its report.md section in the GitHub step summary when CI asks for one."""
    if json_out:
        from .results import json_text

        print(json_text(summary), end="")
        err_console.print(f"results: {out}", highlight=False)
    else:
        render()
        console.print(f"results: [bold]{out}[/]")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        from .report_md import section_markdown

        with open(step_summary, "a", encoding="utf-8") as handle:
            handle.write(section_markdown(out) + "\n")


def gate_lines(summary: dict) -> None:
    """What the gate decided, on stderr (stdout may be JSON)."""
    gate = summary.get("gate")
    if not gate:
        return
    from .gate import describe_failure

    for failure in gate["failures"]:
        err_console.print(f"[bold red]FAIL[/] {describe_failure(failure)}", highlight=False, soft_wrap=True)
    if gate["passed"]:
        tested = gate.get("baseline", {}).get("tests", {})
        against = "; ".join(f"{name} p = {t['p_value']:.3g}" for name, t in tested.items())
        err_console.print("[green]PASS[/] determinism gate" + (f" (baseline: {against})" if against else ""),
                          highlight=False)


def open_engine(options: RunOptions, run, endpoint_options, label: str | None):
    """The engine a flips run decodes through: the server at --endpoint, or the model in process."""
    if endpoint_options is None:
        return in_process_engine(load_with_status(options), run, label)
    from .endpoint.engine import EndpointEngine
    from .models import load_tokenizer

    tokenizer, source = load_tokenizer(options.model)
    with err_console.status(f"connecting to {endpoint_options.base}"):
        engine = EndpointEngine.open(endpoint_options, tokenizer, source, run)
    info = engine.info
    err_console.print(f"endpoint: {engine.label}, model {info.served_model!r}, prompts as {info.prompt_format}"
                      + (f" ({'; '.join(info.notes)})" if info.notes else ""), highlight=False)
    return engine


def _run_flips(options: RunOptions, placement: Placement, out: Path, spec, junit, json_out: bool,
               endpoint_options=None, label: str | None = None) -> int:
    # Imported here so that `--help` and input errors answer without loading torch.
    from . import analysis, data, gate, report, results
    from .engines import engine_kind
    from .flips import open_writer, prepare
    from .junit import flips_junit, write_junit

    run = prepare(options, placement.shard, placement.resume, endpoint_options)
    baseline = attach_gate(run, spec, "flips", {"engine": engine_kind(run)})
    with output_dir(placement, out) as target, open_writer(run, target) as writer:
        engine = None if writer.finishing_only else open_engine(options, run, endpoint_options, label)
        try:
            if baseline is not None and engine is not None:
                gate.check_baseline_prompts(baseline, {r.request_id: data.encode(engine.tokenizer, run.config, r.text)
                                                       for r in run.requests})
            summary, complete = record_with_progress(engine, run, target, writer)
        finally:
            if engine is not None:
                engine.close()
    if not placement.writes:
        return 0
    sequences = results.read_own_table(out, "sequences", results.SEQUENCES_SCHEMA, placement.shard).to_pandas()
    if junit is not None:
        write_junit(junit, flips_junit(summary))

    def render() -> None:
        report.render_flips(console, summary, analysis.batch_pad_lengths(sequences))
        shard_status(placement, out, complete)

    finish_output(out, summary, json_out, render)
    gate_lines(summary)
    return 0 if (summary.get("gate") or {"passed": True})["passed"] else 1


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
    json_out: bool = typer.Option(False, "--json", help="Print calibration.json on stdout (nothing else goes to stdout)."),
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
        code = _run_calibrate(list(runs or []), record_options, options, transfer_items, require_flips, target, json_out)
    raise typer.Exit(code)


def _run_calibrate(runs, record_options, options, transfer_items, require_flips, out, json_out=False) -> int:
    from dataclasses import asdict, replace

    import pandas as pd

    from . import calibrate_run, report, results
    from .flips import open_writer, prepare

    results.prepare_out_dir(out)
    loaded = {}

    def record(opts: RunOptions, folder: Path) -> None:
        # Recording a trace always resumes: an interrupted calibrate continues where it stopped.
        run = prepare(opts, resume=True)
        with open_writer(run, folder) as writer:
            if "lm" not in loaded:
                loaded["lm"] = load_with_status(opts)
            record_with_progress(in_process_engine(loaded["lm"], run), run, folder, writer)

    def is_run(item: str) -> bool:  # a run directory or steps.parquet; anything else names a dataset
        return Path(item).is_dir() or Path(item).suffix == ".parquet"

    inputs = []  # every table read, with the schema version it was written with (older ones are upgraded)

    def traces(item: str):
        path = Path(item)
        if is_run(item):
            steps, source = results.read_steps(path), str(path)
        else:
            steps, source, reused = calibrate_run.traces_for(replace(record_options, dataset=item), record)
            err_console.print(f"{item}: {'reused cached' if reused else 'recorded'} traces in {source}",
                              highlight=False)
        inputs.append({"path": source, "schema_version_read": results.schema_read_from(steps)})
        return steps, source

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
        transfer[Path(item).name if is_run(item) else item] = table
        sources.append(source)

    document, curves = calibrate_run.calibrate(steps, transfer, options, sources)
    device = loaded["lm"].device if "lm" in loaded else "cpu"
    manifest = results.manifest("calibrate", {"runs": [str(r) for r in runs], "record": asdict(record_options),
                                              "safety": str(options.safety), "unit": options.unit,
                                              "confidence": options.confidence, "transfer": transfer_items}, device,
                                inputs=inputs)
    calibrate_run.publish(out, document, curves, steps, manifest)
    finish_output(out, document, json_out, lambda: report.render_calibration(console, document))
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
    baseline: Optional[Path] = BaselineOpt,
    alpha: float = AlphaOpt,
    json_out: bool = JsonOpt,
    prefill: str = PrefillOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    shard: Optional[str] = ShardOpt,
    resume: bool = ResumeOpt,
    tp_plan: Optional[str] = TpPlanOpt,
    batch_invariant: bool = BatchInvariantOpt,
    debug: bool = DebugOpt,
) -> None:
    """Verify: decode in batches under a verification policy; every output must equal its solo reference.

    Free-running batched decoding with MarginGate (`--policy margin`), always-on (`always`), the
    oracle floor (`oracle`) or none, each with `--repair exact` (a solo-exact reference: 100% by
    construction on verified steps) or `--repair column` (the paper's current-column repair).
    Exit codes: 0 ok, 1 determinism below --require-determinism, 2 bad input.

    Examples:

        mgbench verify --threshold-from calibration.json --batch-sizes 4,8,16 \\
            --require-determinism 1.0

        # the negative control: fails

        mgbench verify --policy none --require-determinism 1.0

        mgbench verify --policy margin,always,oracle --repair column,exact \\
            --threshold 0.47 --json

        mgbench verify --needle --batch-sizes 16 --threshold 0.47 --junit v.xml

        # one of 4 processes

        mgbench verify --threshold 0.47 --shard 1/4 --out runs/verify

        mgbench verify --batch-invariant --policy none --require-determinism 1.0
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes)
        options = RunOptions(
            model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=sizes, max_new_tokens=max_new_tokens,
            prefill=prefill, sort_by_length=sort_by_length, dtype=dtype, device=rank_device(device), attn=attn,
            tp_plan=tp_plan, batch_invariant=batch_invariant,
        )
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        if threshold_unit not in ("logit", "ulp"):
            raise UserError(f"--threshold-unit {threshold_unit!r}: choose logit or ulp")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        specs = policy_specs(policy, repair, tau, unit)
        if require_determinism is not None and not 0 <= require_determinism <= 1:
            raise UserError(f"--require-determinism {require_determinism}: use a fraction in [0, 1]")
        from .gate import GateSpec, Thresholds

        gate_spec = GateSpec(Thresholds(), baseline, alpha)
        placement = Placement.resolve(shard, resume, tp_plan, out)
        code = _run_verify(options, placement, specs, needle, require_determinism, junit, json_out,
                           out or default_out("verify", model, dataset), gate_spec)
    raise typer.Exit(code)


def _run_verify(options, placement, specs, needle, required, junit, json_out, out, gate_spec) -> int:
    from . import report, results, verify_run
    from .flips import prepare
    from .junit import junit_xml, write_junit

    run = prepare(options, placement.shard, placement.resume)
    attach_gate(run, gate_spec, "verify", {"policies": [s.label for s in specs], "needle": needle})
    with output_dir(placement, out) as target, verify_run.open_writer(run, specs, needle, target) as writer:
        lm = None if writer.finishing_only else load_with_status(options)
        probe = probe_if_invariant(lm, run)
        with pass_progress("solo (batch size 1)", f"batched x {len(specs)} policies", len(run.requests),
                           len(options.batch_sizes) * len(specs)) as advance:
            summary, complete = verify_run.record_verify(lm, run, specs, needle, required, writer, advance, warn_split,
                                                         probe)
    if not placement.writes:
        return 0
    if junit is not None:
        sequences = results.read_own_table(out, "sequences", verify_run.VERIFY_SEQUENCES_SCHEMA, placement.shard)
        sequences = sequences.to_pandas()
        write_junit(junit, junit_xml(sequences, 1.0 if required is None else required))

    def render() -> None:
        report.render_verify(console, summary)
        shard_status(placement, out, complete)

    finish_output(out, summary, json_out, render)
    gate_lines(summary)
    gate_failed = summary.get("gate") is not None and not summary["gate"]["passed"]
    return 1 if summary["passed"] is False or gate_failed else 0


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
    json_out: bool = JsonOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    tp_plan: Optional[str] = TpPlanOpt,
    debug: bool = DebugOpt,
) -> None:
    """Compare MarginGate with always-on verification, the oracle floor, batch-invariant attention and solo decoding.

    Same prompts, same batches, one process, after a warm-up pass: wall time of the decode
    steps, tokens/s, latency increment over plain batched decoding, trigger rate, repairs and
    sequence-level determinism for each configuration; the increment reduction always/MarginGate
    per repair mode; the gate's own cost; where verification time goes. Writes compare.parquet,
    summary.json, latency_increment.png and determinism_vs_triggers.png.

    Examples:

        mgbench compare --limit 32 --batch-size 8 \\
            --threshold-from calibration.json

        mgbench compare --model llama-3.1-8b --device cuda --batch-size 64 \\
            --limit 256 --threshold 0.5
    """
    with user_errors(debug):
        options = RunOptions(model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=(batch_size,),
                             max_new_tokens=max_new_tokens, prefill="alone", sort_by_length=sort_by_length,
                             dtype=dtype, device=rank_device(device), attn=attn, tp_plan=tp_plan)
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        policy_specs("margin", "exact", tau, unit)  # validates the threshold
        if repeats < 1:
            raise UserError(f"--repeats must be at least 1 (got {repeats})")
        placement = Placement.resolve(None, False, tp_plan, out)
        if placement.shard.sharded:
            raise UserError("compare times one process: run it without torchrun, or under torchrun with --tp-plan auto")
        _run_compare(options, placement, tau, unit, repeats, out or default_out("compare", model, dataset), json_out)


def _run_compare(options, placement, tau, unit, repeats, out, json_out=False) -> None:
    from dataclasses import asdict

    import pyarrow as pa

    from . import SCHEMA_VERSION, analysis, compare_run, plots, report, results
    from .flips import prepare
    from .oom import run_shrinking_on_oom

    run = prepare(options)
    if placement.writes:
        results.prepare_out_dir(out)
    lm = load_with_status(options)
    configs = len(compare_run.configurations(tau, unit))
    with progress_bar() as progress:
        tasks = {"solo": progress.add_task("solo references", total=len(run.requests)),
                 "warmup": progress.add_task("warm-up", total=1),
                 "configs": progress.add_task(f"{configs} configs x {repeats} repeats", total=configs * repeats)}

        def shrink(batch_size: int, half: int) -> None:
            warn_split(batch_size, half)
            for task in tasks.values():
                progress.reset(task)

        batch_size, (runs, extra) = run_shrinking_on_oom(
            options.batch_sizes[0],
            lambda size: compare_run.run_compare(lm, run, tau, unit, size, repeats,
                                                 lambda phase, n: progress.advance(tasks[phase], n)),
            shrink,
        )
    table = analysis.compare_table(runs)
    clean = lambda v: None if isinstance(v, float) and v != v else v  # NaN -> null in JSON
    summary = {
        "model": options.model, "dataset": run.config.name, "batch_size": batch_size,
        "requested_batch_size": options.batch_sizes[0],
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
    if not placement.writes:
        return
    compare_table = pa.Table.from_pandas(runs, preserve_index=False)
    compare_table = compare_table.replace_schema_metadata({results.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    results.publish_run(out, {"compare": compare_table}, {"summary": summary, "manifest": manifest},
                        lambda staging: plots.compare_plots(table, staging))
    finish_output(out, summary, json_out, lambda: report.render_compare(console, summary))


@app.command()
def probe(
    model: str = ModelOpt,
    dataset: str = typer.Option("math500", "--dataset", "-d", help="Where the probe prompt comes from (the longest of a seeded sample)."),
    limit: int = typer.Option(8, "--limit", "-n", help="Sample size the probe prompt is chosen from."),
    seed: int = SeedOpt,
    rows: int = typer.Option(16, "--rows", help="Rows of the probe batch: row counts 1..ROWS and pad lengths 0..ROWS-1 are measured."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    json_out: bool = typer.Option(False, "--json", help="Print probe.json on stdout instead of the table."),
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Probe which parts of one decode step are batch-invariant on this machine, op by op.

    Runs one real decode step over ROWS left-padded rows and replays every linear layer, norm,
    activation, the lm_head and attention on each row alone and on every row count, bitwise.
    Reports, per op: invariant or not, max |diff|, the row counts or pad lengths that differ, and
    the exact form `--batch-invariant` runs it in (the fastest measured); then the whole step,
    plain and in batch-invariant mode, against solo. Writes probe.json and manifest.json.

    Examples:

        mgbench probe

        mgbench probe --rows 8 --json > probe.json

        mgbench probe --model llama-3.1-8b --device cuda --rows 64
    """
    with user_errors(debug):
        if rows < 2:
            raise UserError(f"--rows must be at least 2 (got {rows}): the probe compares a batch with its rows alone")
        options = RunOptions(model=model, dataset=dataset, limit=limit, seed=seed, batch_sizes=(rows,), dtype=dtype,
                             device=device, attn=attn)
        _run_probe(options, rows, json_out, out or default_out("probe", model, dataset))


def _run_probe(options: RunOptions, rows: int, json_out: bool, out: Path) -> None:
    from dataclasses import asdict

    from . import report, results
    from .flips import prepare
    from .probe_run import probe_for_run

    run = prepare(options)  # its one batch size is --rows
    results.prepare_out_dir(out)
    lm = load_with_status(options)
    with err_console.status(f"probing one decode step over {rows} rows"):
        found = probe_for_run(lm, run).to_dict()
    manifest = results.manifest("probe", {**asdict(options), "rows": rows}, lm.device,
                                {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source})
    results.publish_run(out, {}, {"probe": found, "manifest": manifest})
    finish_output(out, found, json_out, lambda: report.render_probe(console, found, options.model, lm.dtype))


@app.command("report")
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run directories of flips, calibrate, verify or compare."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for report.md and its plots (default: reports/report-TIME/)."),
    json_out: bool = typer.Option(False, "--json", help="Print {\"report\": PATH, \"runs\": [...]} on stdout."),
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
    if json_out:
        import json

        print(json.dumps({"report": str(path), "runs": [str(r) for r in runs]}, indent=2))
    else:
        console.print(f"report: [bold]{path}[/]")


@app.command()
def models(json_out: bool = typer.Option(False, "--json", help="Print the aliases as JSON.")) -> None:
    """List the model aliases (any local folder or hub id in the local cache works too)."""
    if json_out:
        import json

        print(json.dumps([{"alias": s.alias, "hub_id": s.hub_id, "default": s.alias == DEFAULT_MODEL,
                           "notes": s.description} for s in REGISTRY.values()], indent=2))
        return
    table = Table(title="models")
    for column in ("alias", "hub id", "notes"):
        table.add_column(column)
    for spec in REGISTRY.values():
        table.add_row(spec.alias + (" (default)" if spec.alias == DEFAULT_MODEL else ""), spec.hub_id, spec.description)
    console.print(table)


@app.command()
def datasets(json_out: bool = typer.Option(False, "--json", help="Print the configs as JSON."),
             debug: bool = DebugOpt) -> None:
    """List the dataset configs under datasets_cfg/ (pass a .toml path for your own)."""
    from .data import config_paths, load_config

    with user_errors(debug):
        if json_out:
            import json
            from dataclasses import asdict

            print(json.dumps([asdict(load_config(name)) for name in config_paths()], indent=2, default=str))
            return
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
