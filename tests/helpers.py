"""Test-only models and perturbation sources. Nothing here is used by mgbench itself."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Vocabulary of the random-init models on random prompts: a tiny model's cost is its head (bf16
# linears on an AVX2 CPU take time in proportion to the weight), and 1,024 ids cost 8x less than 8,192.
VOCAB = 1024


def tiny_llama(hidden: int = 128, vocab: int = VOCAB, layers: int = 2, kv_heads: int = 4, seed: int = 0):
    """Random-init bf16 Llama without grouped-query attention (kv_heads == heads), SDPA attention."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def plant_near_ties(model, eps: float = 0.0005, seed: int = 1) -> None:
    """PLANTED NEAR-TIES: each odd lm_head row becomes its even neighbour plus tiny noise, so every
    step's top-2 is a near-tie that a last-bit difference between solo and batched logits flips."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w[1::2] = w[0::2] + eps * torch.randn(w[1::2].shape, generator=g).to(w.dtype)


def random_prompts(lengths, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


class _PlantedLinear(torch.nn.Linear):
    """A copy of `linear` whose forward a planted variance changes (`rows`: the GEMM's M, every
    leading dimension folded, as a vendor kernel sees it)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        self.load_state_dict(linear.state_dict())

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])


class RowCountPerturbedLinear(_PlantedLinear):
    """PLANTED VARIANCE: a linear layer whose result depends on the row count, as the bf16 GEMMs of
    some CPUs do: called with more than `invariant_up_to` rows, every output is offset by `delta`.
    Stands in for a varying kernel on machines where none varies."""

    def __init__(self, linear: torch.nn.Linear, invariant_up_to: int, delta: float = 0.01):
        super().__init__(linear)
        self.invariant_up_to, self.delta = invariant_up_to, delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.perturb(out) if x.shape[0] > self.invariant_up_to else out

    def perturb(self, out: torch.Tensor) -> torch.Tensor:
        return out + self.delta


class SplitKAboveLinear(_PlantedLinear):
    """PLANTED VARIANCE: above `invariant_up_to` rows the reduction over the input features runs in
    two halves, each rounded to the dtype and then added (a split-K GEMM), as the Xeon's oneDNN
    changes kernel above 32 rows: real rounding differences, not an offset."""

    def __init__(self, linear: torch.nn.Linear, invariant_up_to: int):
        super().__init__(linear)
        self.invariant_up_to = invariant_up_to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        if rows.shape[0] <= self.invariant_up_to:
            return super().forward(x)
        half = self.in_features // 2
        out = torch.nn.functional.linear(rows[:, :half], self.weight[:, :half]) + torch.nn.functional.linear(
            rows[:, half:], self.weight[:, half:], self.bias
        )
        return out.reshape(*x.shape[:-1], self.out_features)


class PositionDependentLinear(_PlantedLinear):
    """PLANTED VARIANCE: in a call of more than one row, rows at odd positions are offset by 0.05
    (a kernel whose bits depend on where a row sits in the call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        out = torch.nn.functional.linear(rows, self.weight, self.bias)
        if rows.shape[0] > 1:
            out[1::2] += 0.05
        return out.reshape(*x.shape[:-1], self.out_features)


class NeighbourDependentLinear(_PlantedLinear):
    """PLANTED VARIANCE: each row is offset by 0.05 * tanh(the sum of the other rows of its call)
    (a kernel whose bits depend on the other rows' content): alone, or beside zero padding, nothing
    moves; beside a copy of itself or other rows, it does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows(x)
        out = torch.nn.functional.linear(rows, self.weight, self.bias)
        sums = rows.float().sum(-1)
        out += (0.05 * torch.tanh(sums.sum() - sums)).unsqueeze(-1).to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def runner_up_past_top(logits: torch.Tensor, below: float) -> torch.Tensor:
    """Where a position's top-1/top-2 margin is below `below`, its runner-up logit becomes one step
    (of the logits' dtype) above the top-1: the argmax moves there, certainly, at a margin of one
    ulp (on an exact tie, to the tied token argmax did not pick). Edits `logits` in place (callers
    pass a head's fresh output) and returns it: the planted heads run on every step of hundreds of
    tests, and `max` (first index on ties, as argmax) on bf16 is 3x faster here than argmax."""
    first, top = logits.max(-1, keepdim=True)
    logits.scatter_(-1, top, torch.full_like(first, float("-inf")))
    second, runner_up = logits.max(-1, keepdim=True)
    logits.scatter_(-1, top, first)
    above = torch.nextafter(first, torch.full_like(first, float("inf")))
    return logits.scatter_(-1, runner_up, torch.where(first - second < below, above, second))


class RowCountNudgedHead(RowCountPerturbedLinear):
    """PLANTED VARIANCE, certain on any machine: an lm_head that, called with more than
    `invariant_up_to` rows, moves the argmax to the runner-up wherever the margin is below `delta`.
    Batched decoding then flips exactly at the steps whose margin is below `delta` (every step
    for a large delta), solo decoding and batch-of-one references never."""

    def perturb(self, out: torch.Tensor) -> torch.Tensor:
        return runner_up_past_top(out, self.delta)


PLANT_MARKER = "mgbench-test-plant.json"  # a model folder carrying it is loaded with its planted head


class SplitPrefillNudgedHead(torch.nn.Module):
    """PLANTED VARIANCE, certain on any machine: an lm_head that moves the argmax to the runner-up
    (wherever the margin is below `delta`) in a forward that continues a cache with more than one
    token: a prompt prefilled in pieces (a prefix-cache hit, a chunk after the first). A prompt
    prefilled whole (alone or left-padded, from position 0) and one-token decode steps never."""

    def __init__(self, head: torch.nn.Module, delta: float):
        super().__init__()
        self.head, self.delta, self.continuing = head, delta, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x)
        return runner_up_past_top(out, self.delta) if self.continuing else out


def plant_split_prefill_head(model, delta: float) -> None:
    head = SplitPrefillNudgedHead(model.lm_head, delta)
    model.lm_head = head

    def flag(module, args, kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        head.continuing = bool(
            ids is not None and ids.shape[-1] > 1 and positions is not None and int(positions.min()) > 0
        )

    model.register_forward_pre_hook(flag, with_kwargs=True)


def plant_nudged_head(model, delta: float, invariant_up_to: int = 1) -> None:
    model.lm_head = RowCountNudgedHead(model.lm_head, invariant_up_to=invariant_up_to, delta=delta)


def plant_every_loaded_model(monkeypatch, delta: float) -> None:
    """Every model the CLI loads in this test gets a nudged head (`delta`): the real default model
    with planted variance, certain on any machine."""
    from mgbench.assets import models

    load = models.load_model

    def load_planted(*args, **kwargs):
        lm = load(*args, **kwargs)
        plant_nudged_head(lm.model, delta)
        return lm

    monkeypatch.setattr(models, "load_model", load_planted)


def plant_from_marker(lm) -> None:
    """TEST-ONLY LOADER HOOK: a local model folder with PLANT_MARKER gets the head it describes."""
    import json
    from pathlib import Path

    marker = Path(lm.source) / PLANT_MARKER
    if marker.is_file():
        plant = json.loads(marker.read_text())
        if plant.get("plant") == "split-prefill":
            plant_split_prefill_head(lm.model, plant["delta"])
        else:
            plant_nudged_head(lm.model, plant["delta"], plant["invariant_up_to"])


# --- command lines -------------------------------------------------------------------------------


def cli_args(command: str, model, out, *extra, limit, batch, tokens, dataset: str = "gsm8k") -> list[str]:
    """`mgbench COMMAND` on a local model folder, writing `out`: flips takes `batch` as
    --batch-size, verify as --batch-sizes."""
    sizes = "--batch-size" if command == "flips" else "--batch-sizes"
    return [
        *(command, "--model", str(model), "--dataset", dataset, "--limit", str(limit), sizes, str(batch)),
        *("--max-new-tokens", str(tokens), "--out", str(out), *extra),
    ]


def raw_margins(tops: list[dict]) -> list[float]:
    """Top-1 minus top-2 logprob of each step, from a raw response's top logprobs {id: logprob}
    (float32, as the tables store it): computed from the server's answer, not by mgbench."""
    import numpy as np

    ranked = [sorted(top.values(), reverse=True) for top in tops]
    return [float(np.float32(values[0] - values[1])) for values in ranked]


# --- independent computations: plain HF calls, none of mgbench's engine -------------------------


def plain_solo(model, prompt: torch.Tensor, steps: int, pad_id: int = 0, with_cache: bool = False):
    """Greedy solo decoding by HF generate: (tokens [steps], logits [steps, vocab]), plus generate's
    own cache (prompt and every fed token) `with_cache`."""
    with torch.inference_mode():
        out = model.generate(
            prompt.view(1, -1),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens, logits = out.sequences[0, len(prompt) :], torch.stack([step[0] for step in out.logits])
    return (tokens, logits, out.past_key_values) if with_cache else (tokens, logits)


def plain_cut_decode(model, prompt: torch.Tensor, cuts: list[int], steps: int, pad_id: int = 0) -> list[int]:
    """Greedy decoding of a prompt prefilled in pieces, by plain HF calls: a forward per piece
    before the last cut into one cache, then HF generate from that cache (it prefills the rest)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    bounds = [0, *cuts]
    with torch.inference_mode():
        for start, end in zip(bounds, bounds[1:]):
            model(
                input_ids=prompt[start:end].view(1, -1),
                attention_mask=torch.ones((1, end), dtype=torch.long),
                position_ids=torch.arange(start, end).view(1, -1),
                cache=cache,
                use_cache=True,
            )
        out = model.generate(
            prompt.view(1, -1),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            cache=cache,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[0, len(prompt) :].tolist()


def _alone_prefilled_cache(model, prompts):
    """Each prompt prefilled alone by a plain forward, the caches left-padded with zeros into one."""
    from transformers import DynamicCache

    total = max(len(p) for p in prompts)
    logits, per_row = [], []
    for p in prompts:
        out = model(input_ids=p.view(1, -1), use_cache=True, logits_to_keep=1)
        logits.append(out.logits[0, -1])
        per_row.append([(layer.keys, layer.values) for layer in out.cache.layers])
    cache = DynamicCache(config=model.config)

    def pad(t, n):  # left-pad a row's [1, heads, n, dim] keys or values to the total length
        return torch.nn.functional.pad(t, (0, 0, total - n, 0))

    for layer in range(len(per_row[0])):
        keys = torch.cat([pad(rows[layer][0], len(p)) for rows, p in zip(per_row, prompts)])
        values = torch.cat([pad(rows[layer][1], len(p)) for rows, p in zip(per_row, prompts)])
        cache.update(keys, values, layer)
    return torch.stack(logits), cache


def plain_teacher_forced(
    model, prompts, solo_tokens: torch.Tensor, prefill: str = "batched", pad_id: int = 0, with_cache: bool = False
):
    """Batched logits [B, steps, vocab] of a left-padded batch fed the solo tokens, by plain HF
    forward calls: one left-padded prefill (`batched`) or each prompt prefilled alone (`alone`);
    `with_cache`, also the batch's cache (left-padded to the longest prompt)."""
    total = max(len(p) for p in prompts)
    mask = torch.zeros((len(prompts), total), dtype=torch.long)
    ids = torch.full_like(mask, pad_id)
    for row, p in enumerate(prompts):
        ids[row, total - len(p) :], mask[row, total - len(p) :] = p, 1
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        if prefill == "alone":
            first, cache = _alone_prefilled_cache(model, prompts)
        else:
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
            )
            first, cache = out.logits[:, -1], out.cache
        logits = [first]
        for step in range(1, solo_tokens.shape[1]):
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
            out = model(
                input_ids=solo_tokens[:, step - 1 : step],
                attention_mask=mask,
                position_ids=(lengths + step - 1).view(-1, 1),
                cache=cache,
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
    return (torch.stack(logits, dim=1), cache) if with_cache else torch.stack(logits, dim=1)


def plain_flip_audit(model, prompts, steps: int, prefill: str = "batched") -> dict:
    """Flips of one batch recomputed independently: solo by HF generate, batched by plain forwards."""
    solos = [plain_solo(model, p, steps) for p in prompts]
    solo_tokens = torch.stack([tokens for tokens, _ in solos])
    solo_logits = torch.stack([logits for _, logits in solos])
    batched = plain_teacher_forced(model, prompts, solo_tokens, prefill)
    flipped = batched.argmax(-1) != solo_tokens
    return {
        "solo_tokens": solo_tokens,
        "batched_token": batched.argmax(-1),
        "flipped": flipped,
        "max_abs_logit_diff": (batched.float() - solo_logits.float()).abs().amax(-1),
    }


def kill_server_after_first_commit(command: list[str], out, server) -> tuple[int, str, dict]:
    """Run an endpoint audit (`command`, writing run directory `out`) in a subprocess, SIGKILL
    `server` once the first group is committed, and wait for the audit to fail:
    (exit code, stderr, {table: the rows committed before the kill})."""
    import subprocess
    import time

    import pandas as pd

    parts = out.parent / f".{out.name}.partial" / "parts"
    running = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (parts / "group-00000.json").exists() and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not (parts / "group-00000.json").exists():
        running.kill()  # never left running, never waited on without a timeout
        _, stderr = running.communicate(timeout=60)
        raise AssertionError(f"no group committed before the deadline or the audit's exit:\n{stderr[-2000:]}")
    server.kill()
    try:
        _, stderr = running.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        running.kill()
        running.communicate(timeout=60)
        raise
    groups = sorted(p.stem.split("-")[1] for p in parts.glob("group-*.json"))
    committed = {
        table: pd.concat([pd.read_parquet(parts / f"{table}-{g}.parquet") for g in groups])
        for table in ("steps", "sequences")
    }
    return running.returncode, stderr, committed


def vllm_venv_ready() -> None:
    """A failure, not a skip, where `make vllm` has not run (make test and .ci/run run it)."""
    import pytest

    from mgbench.engines.endpoint.local_server import VLLM_VENV

    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"no vLLM venv at {VLLM_VENV}: run `make vllm` (make test does) before these tests")


def default_model_flips_args(prefill: str, out) -> list[str]:
    """`mgbench flips` on the default model: 4 math500 requests (seed 7) in one batch of 4, 12 tokens."""
    args = ["flips", "--dataset", "math500", "--limit", "4", "--batch-size", "4", "--max-new-tokens", "12"]
    return [*args, "--prefill", prefill, "--seed", "7", "--out", str(out)]
