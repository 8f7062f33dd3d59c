"""The prefill axes of `mgbench flips` (prefix-cache, chunked-prefill): where a prompt is cut, a
planted split-prefill dependence caught on both and not on the batch axis, a cut that changes
nothing passing, and the unplanted model's outputs agreeing with plain HF calls prefilling the
same pieces."""

import json

import pandas as pd
import pytest
import torch
from helpers import PLANT_MARKER, cli_args, plain_cut_decode, tiny_llama

from mgbench.engines.inprocess.decode import prefill_alone
from mgbench.engines.inprocess.prefill_axes import cut_points, prefill_cut, shared_prefix_length
from mgbench.errors import UserError
from mgbench.runs.options import RunOptions, parse_axes

AXES = "batch,prefix-cache,chunked-prefill"


def test_cut_points_leave_a_token_on_each_side():
    assert cut_points("prefix-cache", 40, 25, 16) == [25]
    assert cut_points("prefix-cache", 20, 25, 16) == [19]  # a prompt no longer than the prefix keeps one token
    assert cut_points("chunked-prefill", 40, 25, 16) == [16, 32]
    assert cut_points("chunked-prefill", 32, 25, 16) == [16]
    assert cut_points("chunked-prefill", 10, 25, 16) == []
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3]]) == 0


def test_bad_axes_are_refused_in_one_line():
    with pytest.raises(UserError, match="choose from batch, prefix-cache, chunked-prefill"):
        RunOptions(axes=parse_axes("batch,prefix"))
    with pytest.raises(UserError, match="repeats"):
        RunOptions(axes=parse_axes("batch,batch"))
    with pytest.raises(UserError, match="--chunk-tokens must be at least 1"):
        RunOptions(axes=("chunked-prefill",), chunk_tokens=0)
    assert RunOptions(axes=parse_axes(AXES), batch_sizes=(4, 8)).passes_per_request == 4


def test_a_prefill_without_cuts_is_the_whole_prefill():
    """Clean by construction: no cut is the same forward as the prefill alone, bit for bit."""
    model, prompt = tiny_llama(hidden=64, vocab=512), torch.arange(5, 45)
    with torch.inference_mode():
        whole, _ = prefill_alone(model, prompt)
        assert torch.equal(prefill_cut(model, prompt, []).logits, whole)


@pytest.fixture(scope="module")
def split_planted_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model folder with a PLANTED split-prefill dependence (helpers.SplitPrefillNudgedHead):
    a forward continuing a cache with more than one token moves the argmax to the runner-up, at
    every step here (the planted near-ties). Prompts prefilled whole never see it."""
    import shutil

    folder = tmp_path_factory.mktemp("split-planted") / "tiny-split-planted"
    shutil.copytree(tiny_model_dir, folder)
    (folder / PLANT_MARKER).write_text(json.dumps({"plant": "split-prefill", "delta": 1.0}))
    return folder


def run_axes(model_dir, out, *extra, limit=4, tokens=6):
    from typer.testing import CliRunner

    from mgbench.cli import app

    args = cli_args("flips", model_dir, out, "--axes", AXES, "--json", *extra, limit=limit, batch=4, tokens=tokens)
    result = CliRunner().invoke(app, args)
    summary = json.loads(result.stdout) if result.stdout.lstrip().startswith("{") else None
    return result, summary, pd.read_parquet(out / "sequences.parquet") if (out / "sequences.parquet").exists() else None


def by_axis(summary) -> dict:
    return {row["axis"]: row for row in summary["by_batch_size"]}


@pytest.fixture(scope="module")
def whole_chunks(tiny_model_dir, tmp_path_factory):
    """The unplanted tiny model on every axis, chunks longer than every prompt: (summary, sequences)."""
    result, summary, sequences = run_axes(tiny_model_dir, tmp_path_factory.mktemp("whole"), "--chunk-tokens", "4096")
    assert result.exit_code == 0, result.output
    return summary, sequences


def test_a_planted_split_prefill_is_caught_on_both_prefill_axes_and_not_on_the_batch_axis(
    split_planted_dir, whole_chunks, tmp_path
):
    """Must fail: every request's first token comes from a forward over a cut prompt, where the
    plant moves it; both prefill axes diverge at token 0 for every request, with a flip at step 0,
    and --require-determinism exits 1 naming the axes. The batch axis prefills whole prompts, which
    the plant never touches: its figures equal the unplanted model's, whatever this machine's
    batched kernels do."""
    clean_summary, clean_sequences = whole_chunks
    # A chunk size that leaves every prompt a last chunk of two tokens or more (a one-token chunk
    # is a forward the plant cannot tell from a decode step).
    lengths = set(clean_sequences["prompt_len"])
    chunk = next(c for c in range(8, 64) if all(n % c != 1 for n in lengths))
    junit = tmp_path / "flips.xml"
    planted, summary, sequences = run_axes(
        split_planted_dir,
        tmp_path / "planted",
        *("--chunk-tokens", str(chunk), "--require-determinism", "1.0", "--junit", str(junit)),
    )
    assert planted.exit_code == 1, planted.output
    rows = by_axis(summary)
    for axis in ("prefix-cache", "chunked-prefill"):
        assert rows[axis]["determinism"] == 0.0 and rows[axis]["flips"] >= 4
        assert rows[axis]["flip_margin_logit_max"] < 1.0  # the planted near-ties: below the plant's delta
        cut = sequences[sequences["axis"] == axis]
        assert len(cut) == 4 and (cut["first_divergence"] == 0).all() and (cut["batch_size"] == 1).all()
    assert summary["prefill_axes"]["chunk_tokens"] == chunk and summary["prefill_axes"]["prefix_tokens"] > 0
    assert "prefix-cache" in planted.stderr and "chunked-prefill" in planted.stderr
    assert 'name="axis=prefix-cache"' in junit.read_text()
    keep = ("steps", "flips", "sequences", "sequences_diverged")
    assert {k: rows["batch"][k] for k in keep} == {k: by_axis(clean_summary)["batch"][k] for k in keep}


def cut_decodes_agree_with_plain_hf(model_dir, summary, sequences, eos_id: int) -> None:
    """Each prefill axis's free-running tokens equal plain HF calls prefilling the same pieces."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    cuts_at = summary["prefill_axes"]
    prefix, chunk = cuts_at.get("prefix_tokens", 0), cuts_at.get("chunk_tokens", 0)
    for row in sequences[sequences["axis"] != "batch"].itertuples():
        prompt = torch.tensor(list(row.prompt_ids))
        cuts = cut_points(row.axis, len(prompt), prefix, chunk)
        assert plain_cut_decode(model, prompt, cuts, len(row.batched_ids), eos_id) == list(row.batched_ids)


def test_the_prefill_axes_agree_with_plain_hf_calls_and_a_chunk_longer_than_every_prompt_changes_nothing(
    tiny_model_dir, whole_chunks, tmp_path, default_tokenizer
):
    """Must pass, clean by construction: chunks longer than every prompt cut nothing, so the
    chunked-prefill axis is 100%. What this machine does to the unplanted model's cut prompts is
    printed and asserted only as agreement: each prefill axis's free-running tokens equal plain
    HF calls prefilling the same pieces (helpers.plain_cut_decode)."""
    summary, sequences = whole_chunks
    assert by_axis(summary)["chunked-prefill"]["determinism"] == 1.0
    cut_decodes_agree_with_plain_hf(tiny_model_dir, summary, sequences, default_tokenizer.eos_token_id)
    cut, summary, sequences = run_axes(
        tiny_model_dir, tmp_path / "cut", "--axes", "chunked-prefill", "--chunk-tokens", "8"
    )
    assert cut.exit_code == 0, cut.output
    print({axis: (r["flips"], r["sequences_diverged"]) for axis, r in by_axis(summary).items()})
    cut_decodes_agree_with_plain_hf(tiny_model_dir, summary, sequences, default_tokenizer.eos_token_id)


def test_prefix_cache_needs_a_shared_prefix_or_a_length(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from mgbench.cli import app

    args = cli_args("flips", tiny_model_dir, tmp_path / "one", "--axes", "prefix-cache", limit=1, batch=1, tokens=4)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--prefix-tokens" in result.stderr
    assert not (tmp_path / "one" / "sequences.parquet").exists()
    endpoint = CliRunner().invoke(app, ["flips", "--endpoint", "http://127.0.0.1:9/v1", "--chunk-tokens", "8"])
    assert endpoint.exit_code == 2 and "--chunk-tokens cannot apply to --endpoint" in endpoint.stderr


@pytest.mark.slow
def test_the_default_model_cut_at_a_multiple_of_every_block_is_printed_and_agrees_with_plain_hf(
    tmp_path, default_tokenizer
):
    """The real default model on both prefill axes, every prompt cut at 32 tokens (a multiple of
    the 8-, 16- and 32-row blocks CPU GEMM kernels tile by). Whether such a cut is exact here is
    printed, never predicted; asserted only as agreement with plain HF calls prefilling the same
    pieces."""
    from mgbench.assets.models import resolve_source

    result, summary, sequences = run_axes(
        "smollm2-135m", tmp_path / "default", "--prefix-tokens", "32", "--chunk-tokens", "32", limit=2, tokens=4
    )
    assert result.exit_code == 0, result.output
    assert (sequences["prompt_ids"].map(len) > 32).all()  # every prompt is cut: the check is not vacuous
    print({axis: (r["flips"], r["sequences_diverged"]) for axis, r in by_axis(summary).items()})
    eos = default_tokenizer.eos_token_id
    cut_decodes_agree_with_plain_hf(resolve_source("smollm2-135m"), summary, sequences, eos)
