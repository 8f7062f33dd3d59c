"""What a run's manifest says about where and how it decoded, compared between runs (no torch).

`mgbench diff` shows the manifest keys whose values differ between the runs it compares (the
machine, the kernel family, the engine and its version, dtype, attention, versions, git revision),
and refuses runs of different models.
"""

from __future__ import annotations

import json

# Manifest keys never shown as differences: they differ between any two runs (times, command
# lines, memory) or are bulky records of their own (a probe's op table, a dataset's config).
NOT_COMPARED = (
    "created_utc",
    "argv",
    "peak_memory",
    "inputs",
    "probe",
    "fixed_order",
    "dataset_config",
    "endpoint.models_entry",
    "endpoint.notes",
    "options.policies",
    "options.require_determinism",
    "endpoint.request_timeout_s",
    "client",
)
# llama.cpp's /props holds its whole default sampling setup and chat template; of it, what names
# the build, the slots and the weights it decoded with.
PROPS = "endpoint.props."
PROPS_COMPARED = ("build_info", "total_slots", "model_path", "model_ftype", "default_generation_settings.n_ctx")
# Where what a reader looks for first (the machine, the kernels, the engine) comes in the list.
SHOWN_FIRST = (
    "device_name",
    "device",
    "kernel_environment",
    "torch_threads",
    "engine",
    "endpoint",
    "dtype",
    "attn",
    "kernels",
    "options.batch_invariant",
    "options.kernels",
    "tensor_parallel",
    "torch",
    "transformers",
    "python",
    "mgbench_version",
    "git_revision",
    "schema_version",
    "model_source",
    "options",
)


def model_identity(manifest: dict) -> str:
    """The model a run decoded (an endpoint run: the tokenizer it encoded prompts with), as its
    alias, hub id or folder names it: a folder's last part, so one model at two paths is one."""
    model = str((manifest.get("options") or {}).get("model") or manifest.get("model") or "?")
    return model.rstrip("/").split("/")[-1]


def flatten(document: dict, prefix: str = "") -> dict:
    """Dotted keys of nested dicts; lists and scalars are values."""
    flat = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if any(name == skip or name.startswith(skip + ".") for skip in NOT_COMPARED):
            continue
        if name.startswith(PROPS) and not any(
            name[len(PROPS) :] == kept or kept.startswith(name[len(PROPS) :] + ".") for kept in PROPS_COMPARED
        ):
            continue
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _shown_rank(key: str) -> tuple[int, str]:
    for rank, prefix in enumerate(SHOWN_FIRST):
        if key == prefix or key.startswith(prefix + "."):
            return rank, key
    return len(SHOWN_FIRST), key


def manifest_differences(manifests: list[dict]) -> list[dict]:
    """The manifest keys whose values are not the same in every run: {key, values (one per run)}."""
    flats = [flatten(manifest) for manifest in manifests]
    keys = sorted({key for flat in flats for key in flat}, key=_shown_rank)
    differences = []
    for key in keys:
        values = [flat.get(key) for flat in flats]
        if len({json.dumps(value, sort_keys=True, default=str) for value in values}) > 1:
            differences.append({"key": key, "values": values})
    return differences
