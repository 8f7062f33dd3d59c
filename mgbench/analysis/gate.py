"""The determinism gate for CI: thresholds on a run's figures, and a regression test against a
recorded baseline run. Pure functions on summaries and tables (no torch, no engine).

The baseline test is paired: both runs decode the same requests, so each (request, batch size,
step) is seen twice. Only discordant pairs carry evidence: b pairs flip now and did not in the
baseline, c pairs flipped then and not now. With no regression, each discordant pair is as likely
one way as the other, so b ~ Binomial(b + c, 1/2), and the one-sided exact p-value is
P(X >= b). Identical runs have b = c = 0 and p = 1. The same test runs on sequences (diverged from
solo now vs then).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mgbench.analysis.figures import with_axis
from mgbench.analysis.step_aggregates import SEQUENCE_KEYS, StepAggregates, aggregate
from mgbench.errors import UserError


@dataclass(frozen=True)
class Thresholds:
    require_determinism: float | None = None  # least share of sequences equal to solo
    max_flip_rate: float | None = None  # most flips / teacher-forced steps

    def __post_init__(self) -> None:
        for name, value in (
            ("--require-determinism", self.require_determinism),
            ("--max-flip-rate", self.max_flip_rate),
        ):
            if value is not None and not 0 <= value <= 1:
                raise UserError(f"{name} {value}: use a fraction in [0, 1]")


@dataclass(frozen=True)
class GateSpec:
    thresholds: Thresholds
    baseline: Path | None = None
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise UserError(f"--alpha {self.alpha}: use a significance level in (0, 1), e.g. 0.01")

    @property
    def active(self) -> bool:
        t = self.thresholds
        return self.baseline is not None or t.require_determinism is not None or t.max_flip_rate is not None


def threshold_failures(figures: dict, thresholds: Thresholds, label: str = "run") -> list[dict]:
    """Which thresholds `figures` (determinism, flip_rate) break, and by how much."""
    failures = []
    if thresholds.require_determinism is not None and figures.get("determinism") is not None:
        if figures["determinism"] < thresholds.require_determinism:
            failures.append(
                {
                    "check": "require-determinism",
                    "where": label,
                    "required": thresholds.require_determinism,
                    "measured": figures["determinism"],
                    "by": thresholds.require_determinism - figures["determinism"],
                }
            )
    if thresholds.max_flip_rate is not None and figures.get("flip_rate") is not None:
        if figures["flip_rate"] > thresholds.max_flip_rate:
            failures.append(
                {
                    "check": "max-flip-rate",
                    "where": label,
                    "required": thresholds.max_flip_rate,
                    "measured": figures["flip_rate"],
                    "by": figures["flip_rate"] - thresholds.max_flip_rate,
                }
            )
    return failures


def describe_failure(failure: dict) -> str:
    if failure["check"] == "baseline":
        return failure["message"]
    op = ">=" if failure["check"] == "require-determinism" else "<="
    return (
        f"{failure['where']}: {failure['check']} needs {op} {failure['required']:.2%}, measured "
        f"{failure['measured']:.2%} (off by {failure['by']:.2%})"
    )


def sign_test_p(worse: int, better: int) -> float:
    """One-sided exact p-value that `worse` of `worse + better` discordant pairs is this high by chance."""
    if worse + better == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(worse, worse + better, 0.5, alternative="greater").pvalue)


def _pairs(current: pd.DataFrame, baseline: pd.DataFrame, keys: list[str], flag: str, carry: tuple = ()):
    """Rows of both runs matched on `keys`: `flag` now, `flag`_baseline then, and `carry` from now."""
    return current[keys + [flag, *carry]].merge(baseline[keys + [flag]], on=keys, suffixes=("", "_baseline"))


def sign_test_stats(pairs: int, bad_now: int, bad_then: int, worse: int, better: int, rows: int) -> dict:
    """The paired test's figures: `pairs` matched, `bad_now`/`bad_then` of them bad in each run,
    `worse` bad now only, `better` bad then only, `rows` of the current run (unpaired = rows - pairs)."""
    return {
        "pairs": pairs,
        "rate": bad_now / pairs if pairs else None,
        "baseline_rate": bad_then / pairs if pairs else None,
        "newly_bad": worse,
        "newly_good": better,
        "p_value": sign_test_p(worse, better),
        "unpaired": rows - pairs,
    }


def _sign_stats(pairs: pd.DataFrame, flag: str, rows: int) -> dict:
    now, then = pairs[flag].astype(bool), pairs[f"{flag}_baseline"].astype(bool)
    worse, better = int((now & ~then).sum()), int((~now & then).sum())
    return sign_test_stats(len(pairs), int(now.sum()), int(then.sum()), worse, better, rows)


def paired_flip_test(current: StepAggregates, baseline: StepAggregates) -> dict:
    """The paired test of `flipped` over steps matched on (request, batch size, step), from each
    run's per-sequence step ranges and flipped steps: the pairs of a sequence are the steps in
    both ranges. Figures as gate.sign-test statistics."""
    for name, aggregates in (("this run", current), ("the baseline", baseline)):
        if aggregates.sequences is None:
            raise UserError(f"{name}'s steps table has no request_id: steps cannot be paired with the baseline")
        seqs = aggregates.sequences
        irregular = seqs[seqs["steps"] != seqs["last_step"] - seqs["first_step"] + 1]
        if len(irregular):
            first = irregular.iloc[0]
            raise UserError(
                f"{name}: the steps of request {first['request_id']} at batch size {first['batch_size']} are not one "
                f"contiguous run of distinct steps ({first['steps']} rows over steps {first['first_step']}.."
                f"{first['last_step']}); the baseline test pairs each step once"
            )
    both = current.sequences.merge(baseline.sequences, on=SEQUENCE_KEYS, suffixes=("", "_baseline"))
    both["lo"] = np.maximum(both["first_step"], both["first_step_baseline"])
    both["hi"] = np.minimum(both["last_step"], both["last_step_baseline"])
    pairs = int(np.maximum(both["hi"] - both["lo"] + 1, 0).sum())

    def paired_flips(flip_steps: pd.DataFrame) -> pd.DataFrame:
        inside = flip_steps.merge(both[SEQUENCE_KEYS + ["lo", "hi"]], on=SEQUENCE_KEYS)
        return inside.loc[(inside["step"] >= inside["lo"]) & (inside["step"] <= inside["hi"]), SEQUENCE_KEYS + ["step"]]

    now, then = paired_flips(current.flip_steps), paired_flips(baseline.flip_steps)
    both_flipped = len(now.merge(then, on=SEQUENCE_KEYS + ["step"]))
    return sign_test_stats(
        pairs=pairs,
        bad_now=len(now),
        bad_then=len(then),
        worse=len(now) - both_flipped,
        better=len(then) - both_flipped,
        rows=current.rows,
    )


def regression(
    current_steps: StepAggregates | None,
    current_sequences: pd.DataFrame,
    baseline_steps: StepAggregates | None,
    baseline_sequences: pd.DataFrame,
    alpha: float,
    group: list[str] | None = None,
) -> dict:
    """Flip rate (steps: teacher-forced flips runs, paired on request, batch size and step from
    the steps tables' aggregates) and diverged share (sequences, paired on `group` + request and
    batch size) against the baseline, each a paired test."""
    group = group or []
    result = {"alpha": alpha, "tests": {}}
    if current_steps is not None and baseline_steps is not None:
        result["tests"]["flip_rate"] = paired_flip_test(current_steps, baseline_steps)
    sequences = with_axis(current_sequences).assign(diverged=~current_sequences["identical"].astype(bool))
    base = with_axis(baseline_sequences).assign(diverged=~baseline_sequences["identical"].astype(bool))
    keys = group + ["request_id", "axis", "batch_size"]
    pairs = _pairs(sequences, base, keys, "diverged", ("first_divergence",))
    result["tests"]["diverged"] = _sign_stats(pairs, "diverged", len(sequences))
    newly = pairs[pairs["diverged"] & ~pairs["diverged_baseline"]].head(5)
    result["newly_diverged"] = [
        {
            **{k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in keys},
            "first_divergence": None if pd.isna(r["first_divergence"]) else int(r["first_divergence"]),
        }
        for _, r in newly.iterrows()
    ]
    result["regressed"] = [name for name, test in result["tests"].items() if test["p_value"] < alpha]
    return result


def condition_label(row: dict) -> str:
    """Where a row of a flips summary's by_batch_size measured: "batch size 8", "prefix-cache",
    "repeat (load 8)" (a repeat row per load size: a short last group makes a smaller load)."""
    axis = row.get("axis", "batch")
    if axis == "batch":
        return f"batch size {row['batch_size']}"
    return f"{axis} (load {row['batch_size']})" if axis == "repeat" else axis


def varies_more_than_the_batch(rows: list[dict]) -> bool:
    """Whether a flips summary's by_batch_size rows hold an axis other than the batch."""
    return any(row.get("axis", "batch") != "batch" for row in rows)


def overall_label(summary: dict) -> str:
    """Where the overall figures of a flips summary measured."""
    return "all batch sizes" if summary.get("axes", ["batch"]) == ["batch"] else "all axes"


def regression_failures(result: dict) -> list[dict]:
    failures = []
    for name in result["regressed"]:
        test = result["tests"][name]
        what = "flip rate" if name == "flip_rate" else "share of diverged sequences"
        newly = ", ".join(
            f"request {r['request_id']} ({condition_label(r)}, token {r['first_divergence']})"
            for r in result["newly_diverged"]
        )
        failures.append(
            {
                "check": "baseline",
                "where": name,
                "message": f"regression against the baseline: {what} {test['rate']:.2%} vs {test['baseline_rate']:.2%} "
                f"({test['newly_bad']} newly bad, {test['newly_good']} newly good of {test['pairs']} pairs; "
                f"one-sided exact p = {test['p_value']:.3g} < alpha {result['alpha']})"
                + (f"; newly diverged: {newly}" if newly else ""),
            }
        )
    return failures


@dataclass
class Baseline:
    path: Path
    manifest: dict
    summary: dict
    steps: StepAggregates | None  # flips runs only (teacher-forced flips), streamed into aggregates
    sequences: pd.DataFrame
    schema_version: str  # the table schema the baseline was recorded with (older ones are upgraded on read)


def load_baseline(path: Path, command: str) -> Baseline:
    """A recorded run of `command` to regress against; one clear line when it is not one."""
    import json

    from mgbench.runs import rundir, schema

    if not (path / "manifest.json").is_file() or not (path / "summary.json").is_file():
        raise UserError(f"--baseline {path}: not a finished mgbench run directory (no manifest.json/summary.json)")
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("command") != command:
        raise UserError(
            f"--baseline {path} is a {manifest.get('command')} run; {command} regresses against a {command} run"
        )
    summary = json.loads((path / "summary.json").read_text())
    if command == "flips":
        steps = aggregate(rundir.table_files(path, "steps"), figures=False)  # only what the test pairs
        sequences = rundir.read_run_table(path, "sequences", schema.SEQUENCES_SCHEMA)
    else:
        from mgbench.runs.schema import VERIFY_SEQUENCES_SCHEMA

        steps, sequences = None, rundir.read_run_table(path, "sequences", VERIFY_SEQUENCES_SCHEMA)
    return Baseline(path, manifest, summary, steps, sequences.to_pandas(), schema.schema_read_from(sequences))


# What a flips run recorded before schema 5 varied, as its options would say it.
AXIS_IDENTITY = {"axes": ["batch"], "prefix_tokens": None, "chunk_tokens": 16}


def run_identity(options: dict, request_ids: list[int], extra: dict | None = None) -> dict:
    """What must be equal for two runs to be compared step by step."""
    keys = ("model", "dataset", "max_new_tokens", "batch_sizes", "prefill", "batch_invariant")
    identity = {**{k: options.get(k) for k in keys}, "requests": sorted(request_ids), **(extra or {})}
    if "axes" in options:  # a flips run: where its prefill axes cut the prompts is part of what it measured
        identity.update({k: options.get(k) for k in AXIS_IDENTITY})
    return identity


def check_baseline(baseline: Baseline, identity: dict) -> None:
    import json

    options = {
        "batch_invariant": False,
        "engine": "in-process",
        **AXIS_IDENTITY,  # a run recorded before the axes varied the batch alone
        **baseline.manifest.get("options", {}),
    }
    recorded = {key: options.get(key) for key in identity}
    recorded["requests"] = sorted(int(r) for r in baseline.sequences["request_id"].unique())
    from mgbench.runs.parts import differences

    identity = json.loads(json.dumps(identity))  # tuples as lists, as the manifest holds them
    differing = differences(recorded, identity)  # "key baseline -> this run"
    if differing:
        raise UserError(
            f"--baseline {baseline.path} is not the same audit (baseline -> this run): {'; '.join(differing)}"
        )


def check_baseline_prompts(baseline: Baseline, prompts: dict[int, list[int]]) -> None:
    """The same request ids must carry the same token ids (a changed chat template changes them)."""
    recorded = {int(r): list(p) for r, p in zip(baseline.sequences["request_id"], baseline.sequences["prompt_ids"])}
    differing = [r for r, ids in prompts.items() if r in recorded and recorded[r] != list(ids)]
    if differing:
        raise UserError(
            f"--baseline {baseline.path} has other prompts: the token ids of requests "
            f"{', '.join(map(str, differing[:5]))} differ (prompt_ids; another tokenizer or template?)"
        )


def evaluate(
    spec: GateSpec,
    summary: dict,
    steps: StepAggregates | None,
    sequences: pd.DataFrame,
    baseline: Baseline | None,
    group: list[str] | None = None,
) -> dict:
    """The gate's verdict on a finished run: thresholds (flips: overall and per batch size) and the
    baseline regression test. `failures` lists what broke and by how much."""
    from dataclasses import asdict

    failures = threshold_failures(summary, spec.thresholds, overall_label(summary))
    by_batch_size = summary.get("by_batch_size", []) if steps is not None else []
    for row in by_batch_size if len(by_batch_size) > 1 else []:  # one condition: the overall line says it
        failures += threshold_failures(row, spec.thresholds, condition_label(row))
    result = {"thresholds": asdict(spec.thresholds)}
    if baseline is not None:
        tested = regression(steps, sequences, baseline.steps, baseline.sequences, spec.alpha, group)
        result["baseline"] = {"path": str(baseline.path), "schema_version_read": baseline.schema_version, **tested}
        failures += regression_failures(tested)
    result["failures"] = failures
    result["passed"] = not failures
    return result
