"""`mgbench flips`: declare the options, build the validated run options, call the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.analysis.gate import GateSpec, Thresholds
from mgbench.cli.exits import user_errors
from mgbench.cli.options import (
    AlphaOpt,
    AttnOpt,
    BaselineOpt,
    BatchInvariantOpt,
    BatchSizeOpt,
    BatchSizesOpt,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KernelsOpt,
    LimitOpt,
    MaxNewOpt,
    ModelOpt,
    OutOpt,
    PrefillOpt,
    ResumeOpt,
    SeedOpt,
    ShardOpt,
    SortOpt,
    TileRowsOpt,
    TpPlanOpt,
    check_output_file,
    default_out,
)
from mgbench.engines.endpoint.client import EndpointOptions
from mgbench.errors import UserError
from mgbench.pipelines.fleet import endpoint_urls, replicas, run_fleet
from mgbench.runs.options import RunOptions, check_axes, parse_axes, parse_batch_sizes
from mgbench.runs.placement import Placement


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
    kernels: str = KernelsOpt,
    tile_rows: Optional[int] = TileRowsOpt,
    axes: str = typer.Option(
        "batch",
        "--axes",
        help=(
            "What to vary against the request alone, comma-separated: batch (it shares a batch), prefix-cache "
            "(a prefix of its prompt computed earlier and reused; --endpoint: the request sent again, warm), "
            "chunked-prefill (its prompt prefilled in chunks; in process), repeat (--endpoint: the same "
            "concurrent load run twice, compared run to run)."
        ),
    ),
    prefix_tokens: Optional[int] = typer.Option(
        None, "--prefix-tokens", help="prefix-cache axis: tokens cached [default: the prefix all prompts share]."
    ),
    chunk_tokens: int = typer.Option(16, "--chunk-tokens", help="chunked-prefill axis: tokens per prefill chunk."),
    require_determinism: Optional[float] = typer.Option(
        None, "--require-determinism", help="Exit 1 when the share of sequences equal to solo is below this (e.g. 1.0)."
    ),
    max_flip_rate: Optional[float] = typer.Option(
        None, "--max-flip-rate", help="Exit 1 when flips / teacher-forced steps is above this (e.g. 0.01)."
    ),
    junit: Optional[Path] = typer.Option(
        None, "--junit", help="Write JUnit XML: one case per dataset and batch size, and the baseline test."
    ),
    baseline: Optional[Path] = BaselineOpt,
    alpha: float = AlphaOpt,
    endpoint: Optional[str] = typer.Option(
        None,
        "--endpoint",
        help=(
            "Audit an OpenAI-compatible server at this base URL (e.g. http://127.0.0.1:8000/v1) instead of "
            "the in-process engine; --model then names the tokenizer. URL1,URL2,...: replicas of one model, "
            "audited one after another into OUT/replica-0, OUT/replica-1, ... (compare them with `mgbench diff`)."
        ),
    ),
    served_model: Optional[str] = typer.Option(
        None, "--served-model", help="--endpoint: the model name the server knows (default: the one /v1/models lists)."
    ),
    top_logprobs: Optional[int] = typer.Option(
        None, "--top-logprobs", help="--endpoint: top-k logprobs asked per token (margins, drift); default 5."
    ),
    request_timeout: Optional[float] = typer.Option(
        None, "--request-timeout", help="--endpoint: seconds to wait for one completion; default 300."
    ),
    needle: bool = typer.Option(
        False, "--needle", help="--endpoint: send each audited request among B-1 filler requests."
    ),
    label: Optional[str] = typer.Option(
        None,
        "--label",
        help="The engine's name in reports (e.g. 'vLLM eager'); default: the server and its version, or in-process.",
    ),
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

        # 0 flips: batched rows reproduce stock solo (about solo cost)

        mgbench flips --batch-invariant --limit 16 --max-new-tokens 32

        # flips against solo through the same fixed-order kernels

        mgbench flips --kernels fixed-order --limit 16 --max-new-tokens 32

        # what a prefix cache and chunked prefill change, beside the batch

        mgbench flips --axes batch,prefix-cache,chunked-prefill --limit 32

        # record a baseline, then gate later runs on it

        mgbench flips --limit 16 --out runs/base

        mgbench flips --limit 16 --baseline runs/base --junit flips.xml

        torchrun --nproc-per-node 8 -m mgbench flips --model llama-3.1-8b \\
            --limit 512 --out runs/m8

        # a served model (vLLM, SGLang, TGI): same prompts, as token ids

        mgbench flips --endpoint http://127.0.0.1:8000/v1 --limit 32 \\
            --batch-size 8 --max-new-tokens 64 --label "vLLM eager"

        # the same server warm (prefix cache) and under the same load twice

        mgbench flips --endpoint http://127.0.0.1:8000/v1 --limit 32 \\
            --axes batch,prefix-cache,repeat

        # replicas of one model: one run each, then their outputs compared

        mgbench flips --endpoint http://node1:8000/v1,http://node2:8000/v1 \\
            --limit 32 --out runs/fleet

        mgbench diff runs/fleet/replica-0 runs/fleet/replica-1
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes else (batch_size,)
        urls = endpoint_urls(endpoint)
        axes_given = parse_axes(axes)
        endpoint_options = endpoint_flips_options(
            urls[0] if urls else None,
            served_model,
            top_logprobs,
            request_timeout,
            needle,
            label,
            {
                "--prefill": prefill != "alone" and f"--prefill {prefill}",
                "--dtype": dtype != "bf16" and f"--dtype {dtype}",
                "--device": device != "auto" and f"--device {device}",
                "--attn": attn != "sdpa" and f"--attn {attn}",
                "--tp-plan": tp_plan is not None and "--tp-plan",
                "--batch-invariant": batch_invariant and "--batch-invariant",
                "--kernels": kernels != "stock" and f"--kernels {kernels}",
                "--shard": shard is not None and "--shard",
                "--prefix-tokens": prefix_tokens is not None and "--prefix-tokens",
                "--chunk-tokens": chunk_tokens != 16 and "--chunk-tokens",
            },
        )
        options = RunOptions(
            model=model,
            dataset=dataset,
            limit=limit,
            seed=seed,
            batch_sizes=sizes,
            max_new_tokens=max_new_tokens,
            prefill=prefill,
            sort_by_length=sort_by_length,
            dtype=dtype,
            device=device,
            attn=attn,
            tp_plan=tp_plan,
            batch_invariant=batch_invariant,
            kernels=kernels,
            tile_rows=tile_rows,
            axes=axes_given,
            prefix_tokens=prefix_tokens,
            chunk_tokens=chunk_tokens,
        )
        check_axes(options.axes, endpoint is not None)
        spec = GateSpec(Thresholds(require_determinism, max_flip_rate), baseline, alpha)
        check_output_file(junit, "--junit")
        placement = Placement.resolve(shard, resume, tp_plan, out)
        target = out or default_out("flips", model, dataset)
        if len(urls) > 1:  # replicas of one served model: one run each, OUT/replica-I
            passed = run_fleet(options, resume, target, spec, junit, json_out, replicas(endpoint_options, urls))
        else:
            from mgbench.pipelines.flips import run_flips  # loads torch: after every input check

            passed = run_flips(options, placement, target, spec, junit, json_out, endpoint_options, label)
    raise typer.Exit(0 if passed else 1)


# Why each in-process option cannot apply to a black box.
BLACK_BOX_REASONS = {
    "--prefill": "the server schedules its own prefill",
    "--dtype": "the server decodes in the dtype it was started with",
    "--device": "the server decodes on its own device",
    "--attn": "the server picks its own attention kernels",
    "--tp-plan": "the server shards the model itself",
    "--batch-invariant": "it patches the in-process model (a server has its own switch, e.g. VLLM_BATCH_INVARIANT=1)",
    "--kernels": "it swaps the in-process model's kernels (a server has its own switch)",
    "--shard": "one client audits a server; several would change the concurrency it sees",
    "--prefix-tokens": "it sets the in-process prefix-cache axis",
    "--chunk-tokens": "it sets the in-process chunked-prefill axis",
}


def endpoint_flips_options(endpoint, served_model, top_logprobs, request_timeout, needle, label, in_process: dict):
    """EndpointOptions for --endpoint (None without it); the in-process options given
    (`in_process`: option -> the text given, or False) refused with the reason."""
    if endpoint is None:
        given = [
            name
            for name, value in (
                ("--served-model", served_model),
                ("--top-logprobs", top_logprobs),
                ("--request-timeout", request_timeout),
                ("--needle", needle or None),
            )
            if value is not None
        ]
        if given:
            extra = " (in-process needle batches: `mgbench verify --needle`)" if "--needle" in given else ""
            raise UserError(f"{', '.join(given)} only apply with --endpoint URL{extra}")
        return None
    for option, given in in_process.items():
        if given:
            raise UserError(f"{given} cannot apply to --endpoint: {BLACK_BOX_REASONS[option]}")
    given = {"top_logprobs": top_logprobs, "request_timeout": request_timeout}  # None: EndpointOptions' default
    return EndpointOptions(
        endpoint,
        served_model,
        needle=needle,
        label=label,
        **{name: value for name, value in given.items() if value is not None},
    )
