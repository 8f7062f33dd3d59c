"""Dataset configs and loaders on the real packaged files."""

import json

import pytest

from mgbench.assets import datasets
from mgbench.errors import UserError


@pytest.mark.parametrize(
    "name,count,field", [("math500", 500, "problem"), ("gsm8k", 1319, "question"), ("humaneval", 164, "prompt")]
)
def test_packaged_datasets_load(name, count, field):
    config = datasets.load_config(name)
    records = datasets.read_records(config)
    assert len(records) == count and field in records[0]


def test_sharegpt_reads_only_complete_records():
    records = datasets.read_records(datasets.load_config("sharegpt"))
    assert len(records) > 17000 and all(r["first_human_turn"].strip() for r in records[:100])


def test_truncated_json_array_yields_complete_objects():
    text = json.dumps([{"a": 1}, {"a": 2}, {"a": 3}])[:-8]  # cut inside the last object
    assert list(datasets.iter_complete_json_array(text)) == [{"a": 1}, {"a": 2}]


def test_seeded_sample_is_deterministic_and_in_order():
    config = datasets.load_config("gsm8k")
    records = datasets.read_records(config)
    first = datasets.select_requests(config, records, 5, seed=7)
    assert first == datasets.select_requests(config, records, 5, seed=7)
    assert [r.request_id for r in first] == sorted(r.request_id for r in first)
    assert first != datasets.select_requests(config, records, 5, seed=8)


def test_local_file_config_with_template():
    config = datasets.load_config("examples/datasets/local-jsonl.toml")
    requests = datasets.select_requests(config, datasets.read_records(config), None, 0)
    assert requests[0].text == "Answer briefly: What is 17 times 23?"


def test_missing_data_file_and_malformed_config(tmp_path):
    missing = tmp_path / "missing.toml"
    missing.write_text('name = "x"\n[source]\nkind = "file"\npath = "nope.jsonl"\n[prompt]\nfield = "q"\n')
    with pytest.raises(UserError, match="does not exist"):
        datasets.read_records(datasets.load_config(str(missing)))
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(UserError, match="malformed"):
        datasets.load_config(str(broken))
    with pytest.raises(UserError, match="unknown dataset"):
        datasets.load_config("no-such-dataset")
