"""A byte-level BPE tokenizer cut to its first ids, for tiny random-init models (benchmarks and
tests): the byte symbols and special tokens have the lowest ids, so every text still encodes
(with fewer merges, so in more tokens) and every id is below the cut. A tiny model's cost is its
vocabulary-wide head: at 4,096 ids instead of the default tokenizer's 49,152 it is 12 times smaller."""

from __future__ import annotations

import json
from pathlib import Path


def trim_tokenizer(path: Path, vocab: int) -> None:
    """Rewrite tokenizer.json at `path` to its first `vocab` ids; ValueError where it cannot be."""
    document = json.loads(path.read_text())
    model = document["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"vocabulary {vocab}: the tokenizer is not a BPE tokenizer; use at least its size")
    kept = {token: i for token, i in model["vocab"].items() if i < vocab}
    if any(t["id"] >= vocab for t in document.get("added_tokens", []) if t.get("special")):
        raise ValueError(f"vocabulary {vocab}: too small for the tokenizer's special tokens")
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    model["vocab"], model["merges"] = kept, merges
    document["added_tokens"] = [t for t in document.get("added_tokens", []) if t["id"] < vocab]
    path.write_text(json.dumps(document, ensure_ascii=False))
