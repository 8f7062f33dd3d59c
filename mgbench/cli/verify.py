"""`mgbench verify`: declare the options, build the validated run options, call the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.analysis.calibration import read_calibration_threshold
from mgbench.analysis.gate import GateSpec, Thresholds
from mgbench.cli.exits import user_errors
from mgbench.cli.options import (
    AlphaOpt,
    AttnOpt,
    BaselineOpt,
    BatchInvariantOpt,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KernelsOpt,
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
from mgbench.errors import UserError
from mgbench.runs.options import RunOptions, parse_batch_sizes
from mgbench.runs.placement import Placement


def verify(
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(16, "--limit", "-n", help="Requests to verify (a seeded sample)."),
    seed: int = SeedOpt,
    batch_sizes: str = typer.Option(
        "8", "--batch-sizes", "-b", help="Batch sizes, all of which must hold, e.g. 1,3,8,16."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per request."),
    policy: str = typer.Option(
        "margin",
        "--policy",
        help="none, always, margin, oracle; with --kernels fixed-order: none, window, margin. A comma list runs each.",
    ),
    repair: str = typer.Option(
        "exact",
        "--repair",
        help="exact (solo-exact reference, the default) or column (the paper's); a comma list runs each.",
    ),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="TAU of the margin policy."),
    threshold_from: Optional[Path] = typer.Option(
        None, "--threshold-from", help="calibration.json from `mgbench calibrate` (TAU and unit)."
    ),
    threshold_unit: str = typer.Option("logit", "--threshold-unit", help="Unit of --threshold: logit or ulp."),
    window: Optional[int] = typer.Option(
        None, "--window", help="W (--kernels fixed-order): tokens per verify row, and the window policy's trigger [64]."
    ),
    verify_rows: Optional[int] = typer.Option(
        None, "--verify-rows", help="N (--kernels fixed-order): rows per verify batch; 1 replays each row alone [8]."
    ),
    needle: bool = typer.Option(False, "--needle", help="Place each request at a random row among filler requests."),
    require_determinism: Optional[float] = typer.Option(
        None,
        "--require-determinism",
        help="Exit 1 when any policy's sequence-level determinism is below this (e.g. 1.0).",
    ),
    junit: Optional[Path] = typer.Option(
        None, "--junit", help="Write JUnit XML (one case per policy, dataset, batch size)."
    ),
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
    kernels: str = KernelsOpt,
    tile_rows: Optional[int] = TileRowsOpt,
    debug: bool = DebugOpt,
) -> None:
    """Verify: decode in batches under a verification policy; every output must equal its solo reference.

    Free-running batched decoding with MarginGate (`--policy margin`), always-on (`always`), the
    oracle floor (`oracle`) or none, each with `--repair exact` (a solo-exact reference: 100% by
    construction on verified steps) or `--repair column` (the paper's current-column repair).
    With `--kernels fixed-order` the reference is solo through the fixed-order kernels: `none`
    decodes through them; `window` (LLM-42) and `margin` decode with the stock kernels and verify
    by replay in verify batches of N rows x W tokens (`--verify-rows`, `--window`).
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

        # against solo through the same fixed-order kernels

        mgbench verify --kernels fixed-order --policy none \\
            --require-determinism 1.0

        # LLM-42's window and MarginGate, replayed in verify batches of 8 x 64

        mgbench verify --kernels fixed-order --policy window,margin \\
            --threshold-from calibration.json --require-determinism 1.0
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes)
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
        )
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        if threshold_unit not in ("logit", "ulp"):
            raise UserError(f"--threshold-unit {threshold_unit!r}: choose logit or ulp")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        from mgbench.engines.inprocess.verification.spec import policy_specs  # loads torch
        from mgbench.pipelines.verify import run_verify

        if kernels != "fixed-order" and (window is not None or verify_rows is not None):
            raise UserError("--window and --verify-rows shape the replays of --kernels fixed-order: add it")
        specs = policy_specs(policy, repair, tau, unit, kernels, window, verify_rows)
        if require_determinism is not None and not 0 <= require_determinism <= 1:
            raise UserError(f"--require-determinism {require_determinism}: use a fraction in [0, 1]")
        gate_spec = GateSpec(Thresholds(), baseline, alpha)
        check_output_file(junit, "--junit")
        placement = Placement.resolve(shard, resume, tp_plan, out)
        passed = run_verify(
            options,
            placement,
            specs,
            needle,
            require_determinism,
            junit,
            json_out,
            out or default_out("verify", model, dataset),
            gate_spec,
        )
    raise typer.Exit(0 if passed else 1)
