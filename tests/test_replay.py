"""Verification by replay against the fixed-order reference: LLM-42's window policy and MarginGate,
each row replayed alone (N = 1) or packed into verify batches of exactly N rows of W tokens.

Controls: a stock-path head planted to force a token the reference never emits must be caught and rolled
back (window, and MarginGate with the end check, at N = 1, 8 and 16: 5 rows, so every packed batch
carries dummy rows) while unverified decoding diverges; tokens that the fixed-order kernels produced
step by step must replay without a rollback (a chunk equals its steps), and a packed verify batch
must give each row the logits it gets replayed alone, bitwise."""

import pytest
import torch
from helpers import VOCAB, cli_args, plant_near_ties, random_prompts, tiny_llama

from mgbench.engines.inprocess.kernels import fixed_order
from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache, StockAlignedCache
from mgbench.engines.inprocess.kernels.fixed_order_probe import probe_fixed_order
from mgbench.engines.inprocess.kernels.sets import Kernels
from mgbench.engines.inprocess.runners import run_solo
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.inprocess.verification.replay import ReplayRepair
from mgbench.engines.inprocess.verification.rows import Row
from mgbench.engines.inprocess.verification.spec import PolicySpec

STEPS = 16
SPECS = (
    [PolicySpec("window", "replay", window=w, rows=n) for w in (4, 64) for n in (1, 8, 16)]
    + [PolicySpec("margin", "replay", tau=0.5, rows=n) for n in (1, 8)]
    + [PolicySpec("margin", "replay", tau=0.5, rows=8, wait=True)]
)
VERIFY_CALLS = sorted({m for spec in SPECS for m in spec.verify_calls})


class StockOnlyForcedToken(torch.nn.Module):
    """PLANTED VARIANCE on the stock path only: during a stock decode step over the start-aligned
    cache, token `token`'s logit becomes one step above the top (a one-ulp margin), so every batched
    stock step emits it; fixed-order forwards (solo reference, replays) are untouched. `token` is one
    the fixed-order solo outputs never contain (checked), so every stock token after the prefill's is
    certainly wrong."""

    def __init__(self, head):
        super().__init__()
        self.head, self.token = head, None

    def forward(self, x):
        out = self.head(x)
        if self.token is None or not isinstance(fixed_order._CACHE.get(), StockAlignedCache):
            return out
        top = out.amax(-1)
        out = out.clone()
        out[..., self.token] = torch.nextafter(top, torch.full_like(top, float("inf")))
        return out


def setup(planted: bool, lengths=(5, 37, 70, 130, 12)):
    model = tiny_llama(kv_heads=2)
    plant_near_ties(model)
    if planted:
        model.lm_head = StockOnlyForcedToken(model.lm_head)
    prompts = random_prompts(list(lengths), vocab=VOCAB, seed=11)
    with torch.inference_mode():
        # Planned for every forward the policies make: decode steps, replays of 1..W tokens, N x W batches.
        probe = probe_fixed_order(model, prompts, rows=len(prompts), calls=VERIFY_CALLS, verify_rows=16)
        assert probe.chunk_vs_steps["exact"]
        kernels = Kernels("fixed-order", probe.plan)
        with kernels.active(model):
            solos = [run_solo(model, p, STEPS, set(), kernels) for p in prompts]
    if planted:
        seen = {t for s in solos for t in s.tokens.tolist()}
        model.lm_head.token = min(set(range(1, VOCAB)) - seen)
    return model, prompts, kernels, solos


def verified(model, prompts, kernels, solos, spec):
    """The batch decoded by the free-running loop under `spec`, verified against fixed-order solo."""
    prefills = [s.row_prefill for s in solos]
    with torch.inference_mode():
        policy = spec.build(model, prompts, prefills, solos, STEPS, kernels=kernels)
        return run_free(model, prompts, prefills, "alone", 0, STEPS, set(), policy)


@pytest.fixture(scope="module")
def planted():
    return setup(planted=True)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.label)
def test_a_planted_stock_flip_is_caught_and_rolled_back(planted, spec):
    model, prompts, kernels, solos = planted
    result = verified(model, prompts, kernels, solos, spec)
    assert result.tokens == [s.tokens.tolist() for s in solos]
    assert all(r >= 1 for r in result.records["rollbacks"]), "every row's first stock token was planted wrong"
    assert all(len(t) == STEPS for t in result.tokens)
    if spec.rows > 1:  # every verify forward computed exactly N rows of W tokens
        assert result.forwards >= 1 and result.fed == result.forwards * spec.rows * spec.window
    if spec.kind == "margin":  # the forced margin is one ulp: the gate fires at every batched step
        assert result.records["triggers"] == result.records["steps"]


def test_unverified_decoding_diverges_where_the_plant_acts(planted):
    model, prompts, kernels, solos = planted
    result = verified(model, prompts, kernels, solos, PolicySpec("none", "replay"))
    for tokens, solo in zip(result.tokens, solos):
        assert tokens[0] == solo.tokens[0] and tokens[1] != solo.tokens[1]  # the prefill's token is shared
    assert sum(result.records["verifications"]) == 0


def test_margin_without_the_end_check_leaves_the_tail_to_the_gate(planted):
    """TAU below the planted one-ulp margin: the gate never fires and nothing is verified."""
    model, prompts, kernels, solos = planted
    result = verified(model, prompts, kernels, solos, PolicySpec("margin", "replay", tau=1e-30, end_check=False))
    assert sum(result.records["verifications"]) == 0 and result.tokens != [s.tokens.tolist() for s in solos]
    checked = verified(model, prompts, kernels, solos, PolicySpec("margin", "replay", tau=1e-30))
    verifications = checked.records["verifications"]
    assert checked.tokens == [s.tokens.tolist() for s in solos] and all(v >= 1 for v in verifications)


def replay_solo_tokens(model, kernels, prompts, solos, spec=PolicySpec("window", "replay", rows=1)) -> list[Row]:
    """Each fixed-order solo output replayed over its prefill, alone (N = 1) or packed (all rows
    ready at once): the rows after the replay."""
    rows = [Row(len(prompt), int(solo.tokens[0]), (0.0, 0.0), 1) for prompt, solo in zip(prompts, solos)]
    with torch.inference_mode():
        verifier = ReplayRepair(kernels, spec.rows, spec.window, True, False)
        decoder = verifier.open(model, prompts, [s.row_prefill for s in solos], "alone", 0, STEPS, kernels)
    with torch.inference_mode(), decoder.decoding():
        for row, solo in zip(rows, solos):
            row.tokens = solo.tokens.tolist()
        if spec.rows == 1:
            for r, row in enumerate(rows):
                verifier.alone(r, row)
        else:
            verifier.packed(rows, list(range(len(rows))))
    return rows


@pytest.mark.parametrize(
    "spec", [PolicySpec("window", "replay", rows=1), PolicySpec("window", "replay", window=8, rows=8)]
)
def test_fixed_order_tokens_replay_without_a_rollback(spec):
    model, prompts, kernels, solos = setup(planted=False)
    for row, solo in zip(replay_solo_tokens(model, kernels, prompts, solos, spec), solos):
        assert row.rollbacks == 0 and row.verified == len(solo.tokens) and row.replayed == len(solo.tokens) - 1


def test_a_packed_verify_batch_equals_its_rows_replayed_alone_bitwise():
    """Five rows of unequal lengths and three dummy rows in one verify batch of 8 x 12 tokens: each
    real row's logits equal those of the same tokens fed to that row alone, unpadded."""
    model, prompts, kernels, solos = setup(planted=False)
    w, layers = 12, [s.row_prefill.layers for s in solos]
    feeds = [s.tokens[: 3 + 2 * r].tolist() for r, s in enumerate(solos)]  # 3, 5, .. tokens per row
    with torch.inference_mode(), fixed_order.fixed_order_kernels(model, kernels.plan):
        fixed = StartAlignedCache.from_prefills(layers, STEPS + w, kernels.plan.chunk, spare=1)
        members = list(range(len(prompts))) + [len(prompts)] * 3
        inputs = torch.tensor([f + [0] * (w - len(f)) for f in feeds] + [[0] * w] * 3)
        starts = torch.tensor([len(p) for p in prompts] + [0] * 3)
        packed = fixed.gather(members, int(starts.max()) + w)
        logits = fixed_order.fixed_order_forward(model, packed, inputs, starts.view(-1, 1) + torch.arange(w))
        for r, feed in enumerate(feeds):
            alone = StartAlignedCache.from_prefills([layers[r]], STEPS + w, kernels.plan.chunk)
            positions = (len(prompts[r]) + torch.arange(len(feed))).view(1, -1)
            expected = fixed_order.fixed_order_forward(model, alone, torch.tensor([feed]), positions)
            assert torch.equal(logits[r, : len(feed)], expected[0]), f"row {r}"


@pytest.mark.slow
def test_default_model_replay_equals_its_fixed_order_steps(default_lm, math500_prompts, math500_prefills):
    model = default_lm.model
    prompts = [torch.tensor(p) for p in math500_prompts]
    # Alone, a row replays at most its STEPS tokens: calls of 1..STEPS rows, probed (the default
    # W = 64 would probe 1..64, most never made here: 32 s of the probe on a 2-core AVX2 EPYC).
    per_row, packed = PolicySpec("window", "replay", rows=1, window=STEPS), PolicySpec("window", "replay", window=8)
    with torch.inference_mode():
        # Planned for the replays' calls too: on an AMX Xeon a 64-row call takes another oneDNN
        # kernel than the 4-row batch (a plan probed at 4 rows only is refused for these replays).
        calls = sorted({*per_row.verify_calls, *packed.verify_calls})
        prefills = math500_prefills  # stock, alone: the probes and the solos share them
        probe = probe_fixed_order(model, prompts, rows=4, calls=calls, verify_rows=8, chunk_tokens=8, prefills=prefills)
        assert probe.chunk_vs_steps["exact"]
        kernels = Kernels("fixed-order", probe.plan)
        with kernels.active(model):
            solos = [run_solo(model, p, STEPS, set(), kernels, prefill) for p, prefill in zip(prompts, prefills)]
    for row, solo in zip(replay_solo_tokens(model, kernels, prompts, solos, per_row), solos):
        assert row.rollbacks == 0 and row.verified == len(solo.tokens)
    result = verified(model, prompts, kernels, solos, packed)
    assert result.tokens == [s.tokens.tolist() for s in solos]
    with torch.inference_mode():
        narrow = Kernels("fixed-order", probe_fixed_order(model, prompts, rows=4, prefills=prefills).plan)
    with pytest.raises(ValueError, match="probed up to"):
        verified(model, prompts, narrow, solos, packed)


def verify_args(model_dir, out, *extra) -> list[str]:
    replays = ("--kernels", "fixed-order", "--policy", "window,margin", "--threshold", "0.5")
    shape = ("--window", "6", "--verify-rows", "4", "--require-determinism", "1.0")
    return cli_args("verify", model_dir, out, *replays, *shape, *extra, limit=4, batch=4, tokens=10)


def test_verify_gates_ci_on_window_and_margin_against_fixed_order_solo(tiny_model_dir, tmp_path, monkeypatch):
    """`verify --kernels fixed-order --policy window,margin --require-determinism 1.0`: passes where
    replays are exact (both policies 100% against fixed-order solo, in verify batches of 4 x 6), and
    exits 1 where a PLANTED query-count dependence makes a replayed chunk differ from its steps (the
    probe warns; the verified tokens are then not the reference's)."""
    from typer.testing import CliRunner

    from mgbench.cli import app

    runner = CliRunner()
    passed = runner.invoke(app, verify_args(tiny_model_dir, tmp_path / "ok", "--json"))
    assert passed.exit_code == 0, passed.output
    summary = __import__("json").loads(passed.stdout)
    labels = {p["policy"]: p for p in summary["policies"]}
    assert set(labels) == {"window W=6/replay N=4", "margin<0.5/replay N=4 (waits)"}
    assert all(p["determinism"] == 1.0 for p in labels.values()) and summary["reference"] == "fixed-order solo"
    shown = runner.invoke(app, ["report", str(tmp_path / "ok"), "--out", str(tmp_path / "report")])
    assert shown.exit_code == 0 and "window W=6/replay N=4" in (tmp_path / "report" / "report.md").read_text()
    real = fixed_order.fixed_order_attention
    monkeypatch.setattr(
        fixed_order, "fixed_order_attention", lambda query, *a: real(query, *a) + 0.05 * (query.shape[2] > 1)
    )
    failed = runner.invoke(app, verify_args(tiny_model_dir, tmp_path / "planted"))
    assert failed.exit_code == 1, failed.output
    assert "replays are not exact against their reference here" in failed.output
