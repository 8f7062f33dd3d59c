"""A start-aligned KV cache for the fixed-order kernels: each row's keys at positions 0..len-1.

No left padding: a row's token at position p is written at p (gpt-fast's `k_out[:, :, input_pos] =
k_val`, with a position per row), so a row's keys sit where they sit when it decodes alone, and
the fixed-order attention reduces them in the same chunks from position 0 whatever the batch.
The buffer is allocated once per batch, chunk-major, [chunks, batch, kv_heads, chunk, head_dim]
per layer (keys transposed within each chunk, [.., head_dim, chunk], as the scores' product reads
them), so the keys of the first n chunks are one contiguous block: the attention's per-chunk
products run as one batched matmul over views, with no per-step copy or concatenation.

Keys and values are stored in float32 (the bf16 values exactly, widened once when written), the
precision the fixed-order attention computes in. Values carry a column of ones after head_dim,
then zeros up to a multiple of 16 columns ([.., chunk, value_width(head_dim)]): the attention's P@V
product sums the softmax's denominator with the ones, and the zeros keep every product's rows a
whole number of vectors (see `value_width`).
A step's writes go through flat indices computed once in `feed`, shared by every layer.
"""

from __future__ import annotations

import torch

from mgbench.engines.inprocess.cache import LayerKV


def prompt_lengths(rows: list[LayerKV]) -> list[int]:
    """Each row's prompt length: its longest layer (sliding-window layers keep fewer keys)."""
    return [max(k.shape[-2] for k, _ in layers) for layers in rows]


VALUE_COLUMNS = 16  # floats per 64 bytes: an AVX-512 vector, two AVX2 ones, a cache line


def value_width(head_dim: int) -> int:
    """Columns of the fixed-order value cache: head_dim, the ones column, zeros to a multiple of 16.
    Measured on an AVX2 EPYC (torch 2.13 CPU): with head_dim + 1 = 65 columns, the float32 batched
    P@V product gave one item other bits inside a batch than alone (the item's offset in the call,
    hence its alignment, changes with the batch); at 72 and 80 columns it did not."""
    return -(-(head_dim + 1) // VALUE_COLUMNS) * VALUE_COLUMNS


def with_ones(values: torch.Tensor) -> torch.Tensor:
    """Values [.., head_dim] with the ones column the fixed-order attention takes, then zeros."""
    head_dim = values.shape[-1]
    extra = values.new_zeros((*values.shape[:-1], value_width(head_dim) - head_dim))
    extra[..., 0] = 1
    return torch.cat([values, extra], -1)


def chunks_for(positions: int, chunk: int) -> int:
    """How many chunks hold `positions` keys."""
    return -(-positions // chunk)


class StartAlignedCache:
    """The cache object the model's attention layers call `update` on during a fixed-order step."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, chunk: int, device):
        self.chunk, self.batch = chunk, batch
        shape = (chunks_for(capacity, chunk), batch, kv_heads, chunk, head_dim)
        transposed = (*shape[:3], head_dim, chunk)
        self.keys = [torch.zeros(transposed, dtype=torch.float32, device=device) for _ in range(layers)]
        self.values = [with_ones(torch.zeros(shape, dtype=torch.float32, device=device)) for _ in range(layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # keys written per row
        self.positions: torch.Tensor | None = None  # [batch, q] positions of the tokens being fed
        self.fed_chunks = 0  # chunks that hold every key up to the furthest position fed
        self._masks: dict = {}
        self._rows = torch.arange(batch, device=device)

    @classmethod
    def from_prefills(
        cls, rows: list[LayerKV], extra: int, chunk: int, lengths: list[int] | None = None, spare: int = 0
    ) -> "StartAlignedCache":
        """The rows' prefills (each computed alone, [1, kv_heads, len, head_dim] per layer) at their
        positions, with room for `extra` more tokens per row, and `spare` empty rows after them (a
        verify batch's dummy rows). A sliding-window layer's prefill keeps only its last keys: they
        go to the prompt's last positions (`lengths`, the prompts' lengths; by default each row's
        longest layer, wrong only where every layer slides)."""
        first = rows[0][0][0]
        lengths = lengths or prompt_lengths(rows)
        batch = len(rows) + spare
        cache = cls(len(rows[0]), batch, first.shape[1], first.shape[-1], max(lengths) + extra, chunk, first.device)
        for row, (layers, length) in enumerate(zip(rows, lengths)):
            for index, (k, v) in enumerate(layers):
                cache._write_span(index, row, length - k.shape[-2], k[0], v[0])
        cache.lengths = torch.tensor(lengths + [0] * spare, device=first.device)
        return cache

    def _write_span(self, layer: int, row: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys [kv_heads, n, head_dim] of one row at positions start..start+n-1."""
        positions = torch.arange(start, start + k.shape[1], device=k.device)
        chunk, offset = positions // self.chunk, positions % self.chunk
        self.keys[layer][chunk, row, :, :, offset] = k.transpose(0, 1).float()
        self.values[layer][chunk, row, :, offset, : v.shape[-1]] = v.transpose(0, 1).float()

    @property
    def capacity(self) -> int:
        return self.values[0].shape[0] * self.chunk

    def feed(self, positions: torch.Tensor) -> None:
        """Positions [batch] or [batch, q] of the tokens the next forward writes and attends from."""
        positions = positions.view(self.batch, -1)
        furthest = int(positions.max())  # the step's one host sync (not one per layer)
        if furthest >= self.capacity:
            raise ValueError(f"position {furthest} is past the cache's capacity {self.capacity}")
        self.positions, self.fed_chunks = positions, chunks_for(furthest + 1, self.chunk)
        self._masks = {}  # one attention mask per window size, shared by the step's layers
        self.lengths = torch.maximum(self.lengths, positions.max(-1).values + 1)
        self._slots = self._write_slots(positions)

    def _write_slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices, into one layer's keys and values, of every element the step writes: [B, q,
        kv_heads, head_dim] in the layout of the new keys (transposed to [B, q, kv_heads, head_dim])."""
        n, batch, kv_heads, chunk, width = self.values[0].shape
        head_dim = self.keys[0].shape[3]
        chunk_of, offset = positions // chunk, positions % chunk  # [B, q]
        block = (chunk_of * batch + self._rows.view(-1, 1)).view(batch, -1, 1, 1) * kv_heads
        block = block + torch.arange(kv_heads, device=positions.device).view(1, 1, -1, 1)  # [B, q, kvh, 1]
        dims = torch.arange(head_dim, device=positions.device).view(1, 1, 1, -1)
        offset = offset.view(batch, -1, 1, 1)
        keys = block * (head_dim * chunk) + dims * chunk + offset
        values = block * (chunk * width) + offset * width + dims
        return keys, values

    def mask_for(self, window, build):
        """The step's attention mask for `window` (built once by `build`, reused by every layer)."""
        if window not in self._masks:
            self._masks[window] = build()
        return self._masks[window]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new keys [batch, kv_heads, q, head_dim] at each row's positions; return the
        first n chunks of keys and values ([n, batch, kv_heads, head_dim, chunk] and [n, batch,
        kv_heads, chunk, head_dim] views), n covering the furthest position fed."""
        key_slots, value_slots = self._slots
        self.keys[layer_idx].put_(key_slots, key.transpose(1, 2).float())
        self.values[layer_idx].put_(value_slots, value.transpose(1, 2).float())
        return self.keys[layer_idx][: self.fed_chunks], self.values[layer_idx][: self.fed_chunks]

    def columns_of_row(self, row: int, start: int, count: int, dtype) -> torch.Tensor:
        """K/V of positions start..start+count-1 of one row: [layers, 2, kv_heads, count, head_dim]
        in `dtype` (the layout `cache.columns_of_row` gives for a left-padded cache)."""
        positions = torch.arange(start, start + count, device=self._rows.device)
        chunk, offset = positions // self.chunk, positions % self.chunk
        return torch.stack(
            [
                torch.stack((k[chunk, row, :, :, offset], v[chunk, row, :, offset, : k.shape[3]])).transpose(1, 2)
                for k, v in self.layers
            ]
        ).to(dtype)

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values))

    def gather(self, members: list[int], positions: int) -> "StartAlignedCache":
        """A cache of the rows `members` (repeats allowed) over their first `positions` positions
        (the chunks a verify batch reads and writes; copied, so the copy grows with the context
        fed, not with the capacity): a verify batch of rows that are not neighbours here.
        `scatter` writes it back."""
        index, n = torch.tensor(members, device=self._rows.device), chunks_for(positions, self.chunk)
        packed = StartAlignedCache.__new__(StartAlignedCache)
        packed.chunk, packed.batch = self.chunk, len(members)
        packed.keys = [k[:n].index_select(1, index) for k in self.keys]
        packed.values = [v[:n].index_select(1, index) for v in self.values]
        packed.lengths = self.lengths.index_select(0, index)
        packed.positions, packed.fed_chunks, packed._masks, packed._slots = None, 0, {}, None
        packed._rows = torch.arange(len(members), device=self._rows.device)
        return packed

    def scatter(self, members: list[int], packed: "StartAlignedCache") -> None:
        """Rows of `packed` (from `gather(members)`) back to their rows here; a row gathered more
        than once (a dummy) takes its first copy."""
        first = {m: i for i, m in reversed(list(enumerate(members)))}
        here = torch.tensor(list(first), device=self._rows.device)
        there = torch.tensor(list(first.values()), device=self._rows.device)
        for mine, theirs in zip(self.keys + self.values, packed.keys + packed.values):
            mine[: theirs.shape[0]].index_copy_(1, here, theirs.index_select(1, there))
        self.lengths = self.lengths.index_copy(0, here, packed.lengths.index_select(0, there))

    def row(self, row: int) -> "StartAlignedCache":
        """One row as a batch of one that shares this cache's storage (a replay writes through it)."""
        view = StartAlignedCache.__new__(StartAlignedCache)
        view.chunk, view.batch = self.chunk, 1
        view.keys = [k[:, row : row + 1] for k in self.keys]
        view.values = [v[:, row : row + 1] for v in self.values]
        view.lengths = self.lengths[row : row + 1].clone()
        view.positions, view.fed_chunks, view._rows, view._masks = None, 0, self._rows[:1], {}
        view._slots = None
        return view


class StockAlignedCache:
    """The stock kernels' cache for decoding that verifies by replay: [batch, kv_heads, capacity,
    head_dim] per layer in the model's dtype, each row's keys at its own positions 0..len-1, so one
    row can move back (a rollback) while the others go on. The stock attention gets a mask of each
    row's own keys (positions up to the one fed)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.batch, self.capacity = batch, capacity
        self.positions: torch.Tensor | None = None
        self.length, self._masks = 0, {}
        self._rows = torch.arange(batch, device=device)

    @classmethod
    def from_prefills(cls, rows: list[LayerKV], extra: int, lengths: list[int] | None = None) -> "StockAlignedCache":
        first = rows[0][0][0]
        lengths = lengths or prompt_lengths(rows)
        cache = cls(
            len(rows[0]), len(rows), first.shape[1], first.shape[-1], max(lengths) + extra, first.dtype, first.device
        )
        for row, (layers, length) in enumerate(zip(rows, lengths)):
            for index, (k, v) in enumerate(layers):  # a sliding-window layer's keys end at the prompt's end
                cache.keys[index][row, :, length - k.shape[-2] : length] = k[0]
                cache.values[index][row, :, length - v.shape[-2] : length] = v[0]
        return cache

    def feed(self, positions: torch.Tensor) -> None:
        """Positions [batch] of the tokens the next step writes (one per row)."""
        self.positions = positions.view(-1)
        self.length = int(self.positions.max()) + 1  # the step's one host sync
        self._masks: dict = {}

    def mask_for(self, window: int | None, dtype) -> torch.Tensor:
        """Additive mask [batch, 1, 1, length] (0 visible, -inf hidden; eager adds it, SDPA takes it):
        each row's own keys up to the position fed, within `window` on a sliding-window layer."""
        if window not in self._masks:
            keys = torch.arange(self.length, device=self.positions.device)
            visible = keys <= self.positions.view(-1, 1)
            if window is not None:
                visible &= keys > self.positions.view(-1, 1) - window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx][self._rows, :, self.positions] = key[:, :, 0]
        self.values[layer_idx][self._rows, :, self.positions] = value[:, :, 0]
        return self.keys[layer_idx][:, :, : self.length], self.values[layer_idx][:, :, : self.length]

    def copy_row_from(self, source: StartAlignedCache, row: int, start: int, count: int) -> None:
        """Positions start..start+count-1 of one row take `source`'s K/V (a replay's, verified)."""
        if count <= 0:
            return
        columns = source.columns_of_row(row, start, count, self.keys[0].dtype)  # [layers, 2, kvh, count, dim]
        for index in range(len(self.keys)):
            self.keys[index][row, :, start : start + count] = columns[index, 0]
            self.values[index][row, :, start : start + count] = columns[index, 1]
