"""Test-only models and perturbation sources. Nothing here is used by mgbench itself."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(hidden: int = 128, vocab: int = 8192, layers: int = 2, kv_heads: int = 4, seed: int = 0):
    """Random-init bf16 Llama without grouped-query attention (kv_heads == heads), SDPA attention."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def plant_near_ties(model, eps: float = 0.0005, seed: int = 1) -> None:
    """PLANTED NEAR-TIES: each odd lm_head row becomes its even neighbour plus tiny noise, so every
    step's top-2 is a near-tie that a last-bit difference between solo and batched logits flips."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w[1::2] = w[0::2] + eps * torch.randn(w[1::2].shape, generator=g).to(w.dtype)


class BatchedRunnerUpNudge(torch.nn.Module):
    """DETERMINISTIC TEST PERTURBATION: wraps lm_head and, only when called with more than one row,
    raises each position's runner-up logit by `delta`. Batched decoding then flips exactly where
    its margin is below `delta`, on any hardware."""

    def __init__(self, lm_head: torch.nn.Module, delta: float):
        super().__init__()
        self.lm_head, self.delta = lm_head, delta

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if hidden.shape[0] > 1:
            runner_up = logits.topk(2, dim=-1).indices[..., 1:]
            logits = logits.scatter_add(-1, runner_up, torch.full_like(runner_up, self.delta, dtype=logits.dtype))
        return logits


def random_prompts(lengths, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


class RowCountPerturbedLinear(torch.nn.Linear):
    """DETERMINISTIC TEST PERTURBATION: a linear layer whose result depends on the row count, as
    the bf16 GEMMs of some CPUs do: called with more than `invariant_up_to` rows, every output is
    offset by `delta`. Stands in for a varying kernel on machines where none varies."""

    def __init__(self, linear: torch.nn.Linear, invariant_up_to: int, delta: float = 0.01):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         dtype=linear.weight.dtype)
        self.load_state_dict(linear.state_dict())
        self.invariant_up_to, self.delta = invariant_up_to, delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.delta if x.shape[0] > self.invariant_up_to else out


def measured_plain_varies(probe) -> str:
    """The fact a positive control rests on, for its assertion message."""
    return (f"the probe measured plain batched decoding differing from solo on this machine "
            f"({probe.machine['cpu']}, {probe.machine['cpu_capability']}): rows {probe.plain_rows_differing}")
