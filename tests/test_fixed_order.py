"""Fixed-order kernels (`--kernels fixed-order`): a start-aligned cache, attention whose reductions
are fixed by construction, row-wise modules in probed forms; the reference is solo decoding through
the same kernels.

Controls: planted row-count and key-length dependences must be caught by the probe (and fall back
to per row, after which the run is exact again); a batch of one equals its solo run by construction;
batched logits equal an independent per-row computation through the same kernels; the attention
agrees with a plain float64 softmax to rounding."""

import json

import pytest
import torch
from helpers import (
    VOCAB,
    NeighbourDependentLinear,
    PositionDependentLinear,
    RowCountPerturbedLinear,
    SplitKAboveLinear,
    plant_near_ties,
    random_prompts,
    tiny_llama,
)
from typer.testing import CliRunner

from mgbench.cli import app
from mgbench.engines.inprocess.kernels import fixed_order
from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache, with_ones
from mgbench.engines.inprocess.kernels.fixed_order import FixedOrderPlan, fixed_order_attention
from mgbench.engines.inprocess.kernels.fixed_order_probe import probe_fixed_order
from mgbench.engines.inprocess.kernels.sets import Kernels, row_prefills
from mgbench.engines.inprocess.runners import run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free

PAD_ID = 0
LENGTHS = [5, 37, 70, 130, 12, 64, 65, 90]  # unequal, across 1-3 chunks of 64 keys
runner = CliRunner()


def gqa_model():
    """Random-init bf16 Llama with grouped-query attention (4 heads over 2 K/V heads), planted near-ties."""
    model = tiny_llama(kv_heads=2)
    plant_near_ties(model)
    return model


def audit(model, prompts, kernels: Kernels, steps: int = 10, prefills=None):
    """(solos, teacher-forced result, free-running result) of one batch through `kernels`; the
    solos start from the prompts' stock `prefills` alone where given (computed once, reused)."""
    prefills = prefills or [None] * len(prompts)
    with torch.inference_mode(), kernels.active(model):
        solos = [run_solo(model, p, steps, set(), kernels, prefill) for p, prefill in zip(prompts, prefills)]
        forced = run_teacher_forced(model, prompts, solos, "alone", PAD_ID, kernels=kernels)
        free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, steps, set(), kernels=kernels)
    return solos, forced, free


def flips_and_diffs(forced) -> tuple[int, float]:
    return (
        sum(int(r["flipped"].sum()) for r in forced.rows),
        max(float(r["max_abs_logit_diff"].max()) for r in forced.rows),
    )


def test_aligned_cache_writes_each_row_at_its_own_positions():
    layers = [
        [(torch.full((1, 2, n, 4), float(r + 1)), torch.full((1, 2, n, 4), -float(r + 1)))]
        for r, n in enumerate((3, 70))
    ]
    cache = StartAlignedCache.from_prefills(layers, extra=5, chunk=64)
    assert cache.capacity == 128 and cache.lengths.tolist() == [3, 70]
    cache.feed(torch.tensor([3, 70]))
    new = torch.stack([torch.full((2, 1, 4), 10.0), torch.full((2, 1, 4), 20.0)])
    keys, values = cache.update(new, -new, 0)
    assert keys.shape == (2, 2, 2, 4, 64) and values.shape == (2, 2, 2, 64, 16)  # 71 keys: two chunks (keys transposed)
    row0 = cache.columns_of_row(0, 0, 4, torch.float32)[0, 0]  # [kv_heads, 4, dim]
    assert row0[:, :3].eq(1.0).all() and row0[:, 3].eq(10.0).all()
    row1 = cache.columns_of_row(1, 68, 3, torch.float32)[0, 1]
    assert row1[:, :2].eq(-2.0).all() and row1[:, 2].eq(-20.0).all()
    assert keys[0, 0, :, :, 4:].eq(0).all() and values[0, 0, :, 4:, :4].eq(0).all()  # nothing past row 0's end
    assert values[..., 4].eq(1).all() and values[..., 5:].eq(0).all()  # the ones column (the denominator), then zeros


def reference_attention(query, keys, values, positions, scaling, window=None):
    """A plain float64 softmax over each query's visible keys, row by row (no chunks)."""
    values = values[..., : keys.shape[3]]  # past head_dim: the ones column (the denominator) and zeros
    n, batch, kv_heads, chunk, dim = values.shape
    flat_k = keys.transpose(3, 4).permute(1, 2, 0, 3, 4).reshape(batch, kv_heads, n * chunk, dim).double()
    flat_v = values.permute(1, 2, 0, 3, 4).reshape(batch, kv_heads, n * chunk, dim).double()
    heads, q = query.shape[1], query.shape[2]
    out = torch.zeros(batch, q, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for t in range(q):
            p = int(positions[b, t])
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                k, v = flat_k[b, h // (heads // kv_heads), lo : p + 1], flat_v[b, h // (heads // kv_heads), lo : p + 1]
                weights = torch.softmax(query[b, h, t].double() @ k.T * scaling, -1)
                out[b, t, h] = weights @ v
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_attention_agrees_with_a_plain_softmax_and_each_row_alone_bitwise(window):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 64, 65, 100, 130]
    batch, q = len(lengths), 2
    keys = torch.randn(3, batch, 2, 16, 64, generator=g)  # [n, B, kv_heads, head_dim, chunk]
    values = with_ones(torch.randn(3, batch, 2, 64, 16, generator=g))
    query = torch.randn(batch, 4, q, 16, generator=g).to(torch.bfloat16)
    positions = torch.tensor([[n - 2, n - 1] for n in lengths])
    out = fixed_order_attention(query, keys, values, positions, 0.25, window)
    expected = reference_attention(query, keys, values, positions, 0.25, window)
    assert torch.allclose(out.double(), expected, atol=2e-2, rtol=2e-2)  # bf16 output rounding
    for r, n in enumerate(lengths):
        chunks = -(-n // 64)
        alone = fixed_order_attention(
            query[r : r + 1], keys[:chunks, r : r + 1], values[:chunks, r : r + 1], positions[r : r + 1], 0.25, window
        )
        assert torch.equal(alone[0], out[r])


def test_batched_equals_fixed_order_solo_bitwise_where_stock_kernels_are_measured():
    """Several batch sizes, unequal lengths, planted near-ties: 0 flips and 0 logit difference
    against the fixed-order solo run. What the stock kernels do on the same batch is printed."""
    model = gqa_model()
    prompts = random_prompts(LENGTHS, vocab=VOCAB, seed=3)
    with torch.inference_mode():
        kernels = Kernels("fixed-order", probe_fixed_order(model, prompts, rows=len(prompts)).plan)
    for size in (2, 5, 8):
        solos, forced, free = audit(model, prompts[:size], kernels)
        assert flips_and_diffs(forced) == (0, 0.0)
        assert free.tokens == [s.tokens.tolist() for s in solos]
    _, stock, _ = audit(model, prompts, Kernels())
    print("stock kernels on the same batch: flips, max |logit diff| =", flips_and_diffs(stock))


def test_a_batch_of_one_equals_its_solo_run():
    model = gqa_model()
    [prompt] = random_prompts([50], vocab=VOCAB, seed=4)
    kernels = Kernels("fixed-order", FixedOrderPlan())
    solos, forced, free = audit(model, [prompt], kernels)
    assert flips_and_diffs(forced) == (0, 0.0) and free.tokens == [solos[0].tokens.tolist()]


def test_batched_logits_equal_an_independent_per_row_computation():
    """The batch in the probed plan against every part forced per row (attention alone over each
    row's own chunks, every linear one row at a time): a different code path, the same bits."""
    model = gqa_model()
    prompts = random_prompts(LENGTHS[:6], vocab=VOCAB, seed=5)
    with torch.inference_mode():
        plan = probe_fixed_order(model, prompts, rows=len(prompts)).plan
    every_linear = {n: "per-row" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    per_row = FixedOrderPlan(forms=every_linear, attention="per-row")
    solos, forced, _ = audit(model, prompts, Kernels("fixed-order", plan), steps=6)
    _, by_row, _ = audit(model, prompts, Kernels("fixed-order", per_row), steps=6)
    for a, b in zip(forced.rows, by_row.rows):
        assert (a["batched_token"] == b["batched_token"]).all() and (a["margin"] == b["margin"]).all()
        assert (a["max_abs_logit_diff"] == 0).all() and (b["max_abs_logit_diff"] == 0).all()


@pytest.fixture()
def planted_key_length_attention(monkeypatch):
    """PLANTED VARIANCE: the batched attention offsets every output by the number of key chunks it
    was handed (the batch's longest row, not the row's own): rows shorter than the longest differ."""
    real = fixed_order.fixed_order_attention

    def planted(query, keys, *args):
        return real(query, keys, *args) + 0.05 * keys.shape[0]

    monkeypatch.setattr(fixed_order, "fixed_order_attention", planted)


def test_probe_rejects_a_planted_key_length_dependence_and_falls_back_per_row(planted_key_length_attention):
    model = gqa_model()
    prompts = random_prompts(LENGTHS, vocab=VOCAB, seed=6)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=len(prompts))
    batched = next(v for v in probe.verdicts if v.part == "attention" and v.form == "batched")
    assert not batched.exact and batched.rows_differing > 0
    assert probe.plan.attention == "per-row"
    assert any(line.startswith("attention: no batched form is exact") for line in probe.fallbacks)
    # The fallback is exact; the form the probe refused is caught by the run itself.
    _, forced, _ = audit(model, prompts, Kernels("fixed-order", probe.plan), steps=6)
    assert flips_and_diffs(forced)[1] == 0.0
    forced_batched = FixedOrderPlan(probe.plan.chunk, probe.plan.forms, "batched")
    _, wrong, _ = audit(model, prompts, Kernels("fixed-order", forced_batched), steps=6)
    assert flips_and_diffs(wrong)[1] > 0


def test_never_one_row_where_a_gemm_differs_at_one_row_only():
    """PLANTED: with more than one row the down projection offsets its output; every count from 2
    up equals two, so "never one row" is exact, the form chosen where a machine's GEMM differs at one
    row only (the AVX-512 EPYC's down_proj)."""
    model = gqa_model()
    mlp = model.model.layers[1].mlp
    mlp.down_proj = RowCountPerturbedLinear(mlp.down_proj, invariant_up_to=1)
    prompts = random_prompts(LENGTHS, vocab=VOCAB, seed=7)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=len(prompts))
    assert probe.plan.forms["model.layers.1.mlp.down_proj"] == "never-one-row"
    _, forced, _ = audit(model, prompts, Kernels("fixed-order", probe.plan), steps=5)
    assert flips_and_diffs(forced)[1] == 0.0


def part_verdicts(probe, part_prefix: str) -> dict:
    return {v.label: v for v in probe.verdicts if v.part.startswith(part_prefix)}


def test_a_gemm_that_changes_its_summation_above_32_rows_runs_in_chunks_or_tiles_at_batch_64():
    """PLANTED, standing in for the AMX Xeon's oneDNN: every MLP projection sums its inputs in two
    rounded halves above 32 rows. At batch 64 neither as is nor "never one row" is exact; chunks of at
    most 32 rows or tiles (every call one shape) are, and the probe takes one of them, not per row
    (which of them is exact on this machine's own kernels is printed, not predicted).
    The run at batch 64 is bitwise its fixed-order solo; the same plan without the forms is not (the
    plant reaches the run). What each form costs on the probe batch is printed."""
    model = gqa_model()
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, SplitKAboveLinear(getattr(layer.mlp, name), invariant_up_to=32))
    prompts = random_prompts([(5 + 17 * i) % 40 + 3 for i in range(64)], vocab=VOCAB, seed=11)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=64)
    verdicts = part_verdicts(probe, "linear mlp.down_proj")
    assert not verdicts["as-is"].exact and verdicts["as-is"].rows_differing > 0
    assert not verdicts["never-one-row"].exact
    form, tile = probe.plan.forms["model.layers.0.mlp.down_proj"], probe.plan.tile
    assert (form == "chunks" and tile <= 32) or form == "tiles", (form, tile)
    assert probe.plan.describe()["tile_rows"] == tile
    chosen = next(v for v in verdicts.values() if v.chosen)
    print(
        f"\n[this machine] planted 32-row GEMM at 64 rows: {chosen.label} {chosen.ms:.3g} ms, "
        + ", ".join(f"{label} {v.ms:.3g} ms" for label, v in verdicts.items() if v is not chosen)
    )
    solos, forced, free = audit(model, prompts, Kernels("fixed-order", probe.plan), steps=4)
    assert flips_and_diffs(forced)[1] == 0.0 and free.tokens == [s.tokens.tolist() for s in solos]
    unformed = FixedOrderPlan(probe.plan.chunk, {}, probe.plan.attention)
    _, wrong, _ = audit(model, prompts, Kernels("fixed-order", unformed), steps=4)
    assert flips_and_diffs(wrong)[1] > 0


def test_a_user_set_tile_is_the_only_one_tried():
    model = gqa_model()
    mlp = model.model.layers[0].mlp
    mlp.down_proj = SplitKAboveLinear(mlp.down_proj, invariant_up_to=4)
    prompts = random_prompts(LENGTHS * 3, vocab=VOCAB, seed=12)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=len(prompts), tile=4)
    assert probe.tiles_tried == [4] and probe.plan.tile == 4
    assert probe.plan.forms["model.layers.0.mlp.down_proj"] in ("chunks", "tiles")  # whichever is exact here
    assert {3, 4, 5, 9} <= set(probe.batch_sizes) and probe.batch_sizes[-3:] == [15, 16, 24]
    with torch.inference_mode():
        wide = probe_fixed_order(model, prompts, rows=len(prompts), tile=20)
    assert wide.tiles_tried == [20] and {19, 20, 21} <= set(wide.batch_sizes) and 41 not in wide.batch_sizes
    _, forced, _ = audit(model, prompts, Kernels("fixed-order", probe.plan), steps=4)
    assert flips_and_diffs(forced)[1] == 0.0


@pytest.mark.parametrize("planted", [PositionDependentLinear, NeighbourDependentLinear])
def test_a_row_whose_bits_depend_on_its_place_or_its_neighbours_refuses_tiles(planted):
    """PLANTED: the down projection's rows depend on their position in the call, or on whether the
    call's other rows hold anything (a zero-padded solo tile does not): no chunk or tile of any size
    is exact, the probe runs it per row (said, with its cost), and the run stays exact."""
    model = gqa_model()
    for layer in model.model.layers:
        layer.mlp.down_proj = planted(layer.mlp.down_proj)
    prompts = random_prompts(LENGTHS * 2, vocab=VOCAB, seed=13)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=len(prompts))
    verdicts = part_verdicts(probe, "linear mlp.down_proj")
    tiled = [v for v in verdicts.values() if v.form in ("chunks", "tiles")]
    assert {v.tile for v in tiled} == {8, 16} and not any(v.exact for v in tiled)
    assert probe.plan.forms["model.layers.0.mlp.down_proj"] == "per-row"
    assert any("down_proj" in line and "runs per row" in line and " ms per row" in line for line in probe.fallbacks)
    _, forced, _ = audit(model, prompts, Kernels("fixed-order", probe.plan), steps=4)
    assert flips_and_diffs(forced)[1] == 0.0


def test_tile_forms_equal_the_module_on_every_row_and_pad_with_zeros():
    from mgbench.engines.inprocess.kernels.fixed_order import in_chunks, in_tiles, run_in_form

    calls = []

    def forward(rows):
        calls.append(tuple(rows.shape))
        return rows * 2

    x = torch.arange(14.0).view(7, 1, 2)
    assert torch.equal(run_in_form(forward, "tiles", x, 3), x * 2) and calls == [(3, 2)] * 3
    calls.clear()
    assert torch.equal(run_in_form(forward, "chunks", x, 3), x * 2) and calls == [(3, 2), (3, 2), (1, 2)]
    calls.clear()
    assert torch.equal(in_tiles(lambda r: r + 1, torch.ones(1, 2), 4), torch.full((1, 2), 2.0))
    assert torch.equal(in_chunks(forward, torch.ones(2, 2), 4), torch.full((2, 2), 2.0)) and calls == [(2, 2)]
    with pytest.raises(ValueError, match="needs a tile size"):
        run_in_form(forward, "tiles", x)
    with pytest.raises(ValueError, match="needs its tile size"):
        FixedOrderPlan(forms={"a": "chunks"})


def test_a_chunk_in_one_forward_equals_step_by_step_and_a_planted_query_count_dependence_is_caught(monkeypatch):
    model = gqa_model()
    prompts = random_prompts(LENGTHS[:4], vocab=VOCAB, seed=8)
    with torch.inference_mode():
        assert probe_fixed_order(model, prompts, rows=4).chunk_vs_steps["exact"]
    real = fixed_order.fixed_order_attention
    monkeypatch.setattr(
        fixed_order, "fixed_order_attention", lambda query, *a: real(query, *a) + 0.05 * (query.shape[2] > 1)
    )
    with torch.inference_mode():
        check = probe_fixed_order(model, prompts, rows=4).chunk_vs_steps
    assert not check["exact"] and check["rows_differing"] > 0


@pytest.mark.slow
def test_default_model_fixed_order_is_bitwise_its_solo_reference(default_lm, math500_prompts, math500_prefills):
    model = default_lm.model
    prompts, prefills = [torch.tensor(p) for p in math500_prompts], math500_prefills
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=4, prefills=prefills)
    assert probe.chunk_vs_steps["exact"]
    kernels = Kernels("fixed-order", probe.plan)
    for size in (2, 4):
        solos, forced, free = audit(model, prompts[:size], kernels, steps=12, prefills=prefills[:size])
        assert flips_and_diffs(forced) == (0, 0.0)
        assert free.tokens == [s.tokens.tolist() for s in solos]


@pytest.mark.slow
def test_default_model_fixed_order_is_bitwise_at_batch_8_32_and_64_on_unequal_prompts(default_lm):
    """The real model and 64 real MATH500 prompts cut to unequal lengths (8-39 tokens), probed at 64
    rows: every teacher-forced logit row at batch 8, 32 and 64 equals its fixed-order solo bitwise,
    and the free-running tokens at 64 too, whatever forms and tile size the probe chose here (printed).
    The prompts' 64 stock prefills alone are most of the test's time (bf16 at about 17 GFLOP/s on
    an AVX2 CPU): what is checked is the decode steps' row count, so the prompts stay short."""
    from mgbench.assets import datasets

    config = datasets.load_config("math500")
    records = datasets.read_records(config)[:64]
    prompts = [
        torch.tensor(datasets.encode(default_lm.tokenizer, config, datasets.prompt_text(config, r))[: 8 + 7 * i % 32])
        for i, r in enumerate(records)
    ]
    model = default_lm.model
    with torch.inference_mode():
        # each prompt prefilled alone once, stock kernels, for the probe and the solos alike
        prefills = row_prefills(model, prompts)
        probe = probe_fixed_order(model, prompts, rows=64, steps=2, prefills=prefills)
        kernels = Kernels("fixed-order", probe.plan)
        print("\n[this machine] default model, fixed-order plan at 64 rows:", probe.plan.describe())
        with kernels.active(model):
            solos = [run_solo(model, p, 4, set(), kernels, prefill) for p, prefill in zip(prompts, prefills)]
            for size in (8, 32, 64):
                forced = run_teacher_forced(model, prompts[:size], solos[:size], "alone", PAD_ID, kernels=kernels)
                assert flips_and_diffs(forced) == (0, 0.0), size
            free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, 4, set(), kernels=kernels)
            assert free.tokens == [s.tokens.tolist() for s in solos]


def test_cli_flips_fixed_order_names_its_reference(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "flips",
            "--model",
            str(tiny_model_dir),
            "--dataset",
            "gsm8k",
            "--limit",
            "6",
            "--batch-sizes",
            "1,3,6",
            "--max-new-tokens",
            "8",
            "--kernels",
            "fixed-order",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kernels"] == "fixed-order" and summary["reference"] == "fixed-order solo"
    assert summary["flips"] == 0 and summary["determinism"] == 1.0
    fixed = summary["fixed_order"]
    assert fixed["stock_solo"]["requests"] == 6 and 0 <= fixed["stock_solo"]["identical"] <= 6
    assert fixed["chunk_vs_steps"]["exact"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["kernels"] == "fixed-order" and manifest["kernels"] == "fixed-order"
    assert "solo decoding through the same fixed-order kernels" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["flips", "--kernels", "fixed-order", "--batch-invariant"], "choose one"),
        (["flips", "--kernels", "fixed-order", "--prefill", "batched"], "prefills each request alone"),
        (["flips", "--kernels", "fastest"], "--kernels 'fastest'"),
        (["flips", "--kernels", "fixed-order", "--endpoint", "http://127.0.0.1:9"], "cannot apply to --endpoint"),
        (["verify", "--kernels", "fixed-order", "--policy", "always"], "choose from none, window, margin"),
        (["verify", "--policy", "window"], "add --kernels fixed-order"),
        (["verify", "--policy", "none", "--verify-rows", "8"], "add it"),
        (["verify", "--kernels", "fixed-order", "--policy", "window", "--verify-rows", "0"], "--verify-rows 0"),
        (["verify", "--kernels", "fixed-order", "--policy", "margin"], "needs --threshold"),
    ],
)
def test_cli_refuses_fixed_order_combinations_in_one_line(args, message, tmp_path):
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "x").exists()


def test_cli_probe_fixed_order_json(tiny_model_dir, tmp_path):
    result = runner.invoke(
        app,
        [
            "probe",
            "--model",
            str(tiny_model_dir),
            "--kernels",
            "fixed-order",
            "--rows",
            "4",
            "--dataset",
            "gsm8k",
            "--json",
            "--out",
            str(tmp_path / "p"),
        ],
    )
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["kind"] == "mgbench.fixed_order_probe" and found["batch_sizes"] == [1, 2, 3, 4]
    parts = {v["part"] for v in found["verdicts"]}
    assert "attention" in parts and any(p.startswith("linear lm_head") for p in parts)
    assert all(sum(v["chosen"] for v in found["verdicts"] if v["part"] == p) == 1 for p in parts)
    # report.md renders the verdicts: one table row per (part, form), and the chunk check's figures.
    report = runner.invoke(app, ["report", str(tmp_path / "p"), "--out", str(tmp_path / "r")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "r" / "report.md").read_text()
    assert sum(line.startswith("| attention |") for line in text.splitlines()) == 2
    check = found["chunk_vs_steps"]
    assert f"{check['rows_differing']} of {check['rows']} logit rows differ" in text


def tiny_gemma3(window: int = 16):
    """Random-init bf16 Gemma 3 (QK-norm, a sliding-window layer whose window the prompts exceed, one
    K/V head for four query heads), planted near-ties."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        attn_implementation="sdpa",
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
    plant_near_ties(model)
    return model


def test_gemma3_sliding_window_and_qk_norm_fixed_order_is_bitwise_its_solo():
    """A second architecture: the sliding layer's window (16) is shorter than every prompt, so the
    attention's window mask is exercised; it also agrees with Gemma's own attention to rounding."""
    model = tiny_gemma3()
    prompts = random_prompts([20, 40, 70, 100, 33], vocab=VOCAB, seed=9)
    with torch.inference_mode():
        probe = probe_fixed_order(model, prompts, rows=len(prompts))
    assert probe.chunk_vs_steps["exact"]
    kernels = Kernels("fixed-order", probe.plan)
    solos, forced, free = audit(model, prompts, kernels, steps=8)
    assert flips_and_diffs(forced) == (0, 0.0)
    assert free.tokens == [s.tokens.tolist() for s in solos]
    # The first decode steps agree with Gemma's own SDPA attention to bf16 rounding: the fixed-order
    # kernels change bits, not the computation. (Short prompts: the stock path's K/V columns need the
    # prompt inside the window; the window mask itself is checked against float64 above.)
    short = random_prompts([6, 9, 12], vocab=VOCAB, seed=10)
    fixed_short, _, _ = audit(model, short, kernels, steps=3)
    with torch.inference_mode():
        for prompt, solo in zip(short, fixed_short):
            stock = run_solo(model, prompt, 2, set())
            assert torch.equal(stock.row_prefill.logits, solo.row_prefill.logits)  # the prefill alone: the same call
            assert torch.allclose(stock.top_logits[1], solo.top_logits[1], atol=0.05, rtol=0.02)


def test_a_prefill_alone_inside_the_fixed_order_kernels_is_the_stock_prefill_bitwise():
    """compare's fixed-order solo and the default-model tests reuse a stock prefill alone
    (`run_solo(prefill=)`, `probe_fixed_order(prefills=)`): sound only if the fixed-order kernels
    leave a prefill alone as the model computes it. The plan runs a PLANTED position-dependent
    linear per row and the attention per row; the control: that form changes the linear's output
    on the prefill's many rows. The prefill inside the kernels' block equals the one outside."""
    from mgbench.engines.inprocess.kernels.fixed_order import run_in_form

    model = tiny_llama(kv_heads=2)
    mlp = model.model.layers[0].mlp
    mlp.down_proj = PositionDependentLinear(mlp.down_proj)
    [prompt] = random_prompts([40], vocab=VOCAB, seed=14)
    plan = FixedOrderPlan(forms={"model.layers.0.mlp.down_proj": "per-row"}, attention="per-row")
    with torch.inference_mode():
        outside = row_prefills(model, [prompt])[0]
        with Kernels("fixed-order", plan).active(model):
            inside = row_prefills(model, [prompt])[0]
        rows = torch.randn(40, mlp.down_proj.in_features, dtype=torch.bfloat16)
        assert not torch.equal(run_in_form(mlp.down_proj.forward, "per-row", rows), mlp.down_proj(rows))
    assert torch.equal(inside.logits, outside.logits)
    for (k_in, v_in), (k_out, v_out) in zip(inside.layers, outside.layers):
        assert torch.equal(k_in, k_out) and torch.equal(v_in, v_out)
