"""`InProcessEngine`: the shared decode engine on a loaded model, behind the audit interface."""

from __future__ import annotations

from dataclasses import asdict

from mgbench.engines.inprocess.audit import audit_groups
from mgbench.engines.interface import run_options
from mgbench.runs import rundir


class InProcessEngine:
    method = "teacher-forced"

    def __init__(self, lm, probe=None):
        self.lm, self.probe = lm, probe  # probe: the ProbeReport a --batch-invariant run plans with
        self.tokenizer = lm.tokenizer
        self.label = f"in-process ({lm.attn}{', batch-invariant' if probe is not None else ''})"

    def audit(self, run, prompts, wanted, on_progress, on_split):
        return audit_groups(
            self.lm.model,
            self.tokenizer,
            run.requests,
            prompts,
            run.options,
            run.max_new_tokens,
            run.config.name,
            self.lm.device,
            wanted=wanted,
            on_progress=on_progress,
            on_split=on_split,
            plan=self.probe.plan if self.probe is not None else None,
        )

    def manifest(self, run) -> dict:
        lm = self.lm
        return rundir.manifest(
            "flips",
            run_options(run),
            lm.device,
            {
                "engine": {"kind": "in-process", "label": self.label, "method": self.method},
                "dtype": lm.dtype,
                "attn": lm.attn,
                "model_source": lm.source,
                "dataset_config": asdict(run.config),
                **({"probe": self.probe.to_dict()} if self.probe is not None else {}),
            },
            inputs=run.inputs,
        )

    def close(self) -> None:
        pass
