"""`InProcessEngine`: the shared decode engine on a loaded model, behind the audit interface."""

from __future__ import annotations

from dataclasses import asdict

from mgbench.engines.inprocess.audit import audit_groups
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels
from mgbench.engines.interface import run_options
from mgbench.runs import rundir


def tensor_parallel_facts(tp_plan: str | None) -> dict:
    """What a tensor-parallel run's figures cover: rank 0 audits, and its K/V cache holds only its
    slice of the key/value heads, so the steps table's K/V deltas measure those heads alone."""
    if not tp_plan:
        return {}
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    return {
        "tensor_parallel": {
            "tp_plan": tp_plan,
            "ranks": ranks,
            "kv_delta_heads": "rank 0's kv heads only",
            "note": "kv_delta_mean and kv_delta_max (steps table) cover the key/value heads of rank 0's "
            "shard of the model, not every head; logits, tokens and margins are the whole model's",
        }
    }


class InProcessEngine:
    method = "teacher-forced"

    def __init__(self, lm, probe=None, kernels: Kernels = STOCK, kernel_facts: dict | None = None):
        self.lm, self.probe = lm, probe  # probe: the ProbeReport a --batch-invariant run plans with
        self.kernels, self.kernel_facts = kernels, kernel_facts  # fixed-order: the plan and its probe's summary
        self.tokenizer = lm.tokenizer
        mode = ", batch-invariant (stock solo)" if probe is not None else ""
        mode += ", fixed-order kernels" if kernels.fixed_order else ""
        self.label = f"in-process ({lm.attn}{mode})"

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
            kernels=self.kernels,
            kernel_facts=self.kernel_facts,
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
                "kernels": self.kernels.name,
                **({"fixed_order": self.kernel_facts} if self.kernels.fixed_order else {}),
                **tensor_parallel_facts(run.options.tp_plan),
            },
            inputs=run.inputs,
        )

    def close(self) -> None:
        pass
