"""KV cache operations on transformers' DynamicCache ([batch, kv_heads, seq, head_dim] per layer).

Rows of a batched cache are left-padded: row r's real tokens sit at [pad_len[r], seq).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

# One (keys, values) pair per layer, each [batch, kv_heads, seq, head_dim].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def cache_from_layers(layers: LayerKV, config) -> DynamicCache:
    return DynamicCache(ddp_cache_data=layers, config=config)


def cache_layers(cache: DynamicCache) -> LayerKV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def clone_layers(layers: LayerKV) -> LayerKV:
    return [(k.clone(), v.clone()) for k, v in layers]


def left_pad_stack(rows: list[LayerKV], config) -> tuple[DynamicCache, list[int]]:
    """Stack single-row caches of different lengths into one left-padded batched cache.

    Pad slots are zero; the attention mask keeps them out of every softmax.
    """
    lengths = [layers[0][0].shape[-2] for layers in rows]
    total = max(lengths)
    stacked: LayerKV = []
    for layer_idx in range(len(rows[0])):
        keys, values = [], []
        for layers, length in zip(rows, lengths):
            k, v = layers[layer_idx]
            pad = total - length
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        stacked.append((torch.cat(keys), torch.cat(values)))
    return cache_from_layers(stacked, config), [total - n for n in lengths]


def row_slice(cache: DynamicCache, row: int, pad_len: int) -> LayerKV:
    """Row `row`'s unpadded cache as a batch-of-one copy (the batch's values, padding dropped)."""
    return [
        (k[row : row + 1, :, pad_len:].clone(), v[row : row + 1, :, pad_len:].clone()) for k, v in cache_layers(cache)
    ]


def read_column(cache: DynamicCache, row: int, position: int) -> LayerKV:
    """The K/V column at cache index `position` of one row, per layer, each [kv_heads, head_dim]."""
    return [(k[row, :, position].clone(), v[row, :, position].clone()) for k, v in cache_layers(cache)]


def write_column(cache: DynamicCache, row: int, position: int, column: LayerKV) -> None:
    """Overwrite one row's K/V column at cache index `position` in every layer, in place."""
    for layer, (k_col, v_col) in zip(cache.layers, column):
        layer.keys[row, :, position] = k_col
        layer.values[row, :, position] = v_col


def columns_of_row(cache: DynamicCache, row: int, start: int, count: int) -> torch.Tensor:
    """K/V of `count` consecutive columns of one row: [layers, 2, kv_heads, count, head_dim]."""
    return torch.stack(
        [
            torch.stack((k[row, :, start : start + count], v[row, :, start : start + count]))
            for k, v in cache_layers(cache)
        ]
    )
