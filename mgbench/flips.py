"""The flips pipeline: dataset -> prompts -> audit -> tables -> published run directory.

Shared by `mgbench flips` and by `mgbench calibrate`, which records its traces through it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from . import analysis, data, results
from .audit import ProgressFn, run_audit
from .config import RunOptions


@dataclass
class PreparedRun:
    options: RunOptions
    config: data.DatasetConfig
    requests: list[data.Request]
    max_new_tokens: int


def prepare(options: RunOptions) -> PreparedRun:
    """Everything that can fail on bad input, checked before a model is loaded."""
    config = data.load_config(options.dataset)
    requests = data.select_requests(config, data.read_records(config), options.limit, options.seed)
    return PreparedRun(options, config, requests, options.max_new_tokens or config.max_new_tokens)


def record_flips(lm, run: PreparedRun, out: Path, on_progress: ProgressFn) -> dict:
    """Decode, analyse and publish one flips run; returns its summary."""
    options, config = run.options, run.config
    prompts = [data.encode(lm.tokenizer, config, request.text) for request in run.requests]
    records = run_audit(
        lm.model, lm.tokenizer, run.requests, prompts, options, run.max_new_tokens, config.name, lm.device,
        on_progress=on_progress,
    )
    steps = results.steps_table(records.steps, options.model, config.name)
    sequences = results.sequences_table(records.sequences, options.model)
    batched_seconds = sum(records.batched_seconds.values())
    summary = {
        "model": options.model,
        "dataset": config.name,
        "prefill": options.prefill,
        "max_new_tokens": run.max_new_tokens,
        "batch_sizes": list(options.batch_sizes),
        **analysis.summarize_flips(steps.to_pandas(), sequences.to_pandas()),
        "solo_tokens_per_s": records.solo_tokens / records.solo_seconds if records.solo_seconds > 0 else None,
        "batched_tokens_per_s": sum(records.batched_tokens.values()) / batched_seconds if batched_seconds > 0 else None,
        "batched_tokens_per_s_by_batch_size": {
            str(b): records.batched_tokens[b] / s if s > 0 else None for b, s in records.batched_seconds.items()
        },
    }
    run_manifest = results.manifest(
        "flips", {**asdict(options), "max_new_tokens": run.max_new_tokens}, lm.device,
        {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source, "dataset_config": asdict(config)},
    )
    results.publish_run(out, {"steps": steps, "sequences": sequences}, {"summary": summary, "manifest": run_manifest})
    return summary
