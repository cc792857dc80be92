"""A left-padded batch KV cache that rows join and leave between decode steps.

Continuous batching: every active request is one row of per-layer keys/values (B, H, S, D),
left-padded to a common length S, in a store with spare rows and columns that decode steps and
joining rows write into in place (serving/decode.py's lean step, or Hugging Face's forward on a
`DynamicCache` view). `mask` (B, S) marks real columns; `positions` (B,) is each row's next
position id, so RoPE sees true positions whatever the padding. A new row (its own prefill cache,
no padding) is written into a free row, right-aligned (a longer one widens the batch to the
left); finished rows leave, and rows from the end move into their places; columns that are
padding in every remaining row are trimmed off the left. Padded keys/values are zeros and
masked out, so a row's attention never reads another row's or a pad's values.

Requests that arrive together are prefilled in one forward (`prefill_inputs`): each row's cached
prefix (serving/prefix_cache.py) right-aligned in the past columns, its new tokens right-aligned
in the input columns, pads masked, so every row's last column is its last prompt token.
`joined_row_kv` then takes each row's real columns out as its own cache, to join the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from serving.prefix_cache import PrefixHit


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (B, H, S, D)


def _layers(cache: Any) -> list[Any]:
    return list(cache.layers)


def _spare(width: int) -> int:
    """Free columns a new store keeps on each side of `width` live ones: decode steps write
    into those after them in place, rows longer than the batch widen it into those before,
    until they run out (then the store is copied once into a bigger one)."""
    return max(64, width // 2)


class PaddedKVBatch:
    """The shared cache of all active rows (see module doc). Rows are indexed 0..B-1.

    Each layer's keys and values live in a store (R, H, C, D) with room for more rows than
    are live (R >= B) and free columns on both sides of the live ones: the live columns are
    `[start, start + width)`, a decode step writes its column right after them in place
    (`step_kv`), and trimming the left is moving `start`. A joining row is written into the
    next free row, right-aligned, with its padding zeroed; one longer than the batch widens it
    into the free columns on the left (zeroed for the other rows). Rows that leave are filled
    by rows from the end (`compact_order`). So a step copies only the rows that join or move;
    the store is copied when it runs out of rows or columns (then with room to spare)."""

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._start = 0
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # (B, S) 1 = real column
        self.positions = torch.zeros(0, dtype=torch.long)  # (B,) next position id per row

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def kv(self) -> KV:
        """Every layer's live keys/values (B, H, S, D): views into the store."""
        rows, end = len(self), self._start + self.width
        return [(k[:rows, :, self._start:end], v[:rows, :, self._start:end])
                for k, v in zip(self._keys, self._values, strict=True)]

    def _restore(self, template: KV, *, rows: int, width: int) -> None:
        """A new store with room for `rows` rows and `width` live columns (free columns on
        both sides), the live rows copied in, right-aligned and left-padded with zeros;
        `template`: a layer's keys/values of the right head count and size."""
        live, left = self.kv(), _spare(width)
        columns = left + width + _spare(width)

        def store(like: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
            new = like.new_empty(rows, like.shape[1], columns, like.shape[3])
            if old is not None:
                b, s = old.shape[0], old.shape[2]
                new[:b, :, left:left + width - s] = 0
                new[:b, :, left + width - s:left + width] = old
            return new

        olds: list[tuple[Any, Any]] = list(live) or [(None, None)] * len(template)
        self._keys = [store(k, old) for (k, _), (old, _) in zip(template, olds, strict=True)]
        self._values = [store(v, old) for (_, v), (_, old) in zip(template, olds, strict=True)]
        self._start = left

    def add(self, row_kv: KV, length: int) -> None:
        """Append one row: `row_kv` per layer (1, H, length, D), all real tokens."""
        self.extend([(row_kv, length)])

    def extend(self, rows: Sequence[tuple[KV, int]]) -> None:
        """Append rows after the live ones, each (per-layer keys/values (1, H, n, D), n real
        tokens), copying only them unless the store must grow."""
        if not rows:
            return
        lengths = [length for _, length in rows]
        old, live = self.width, len(self)
        width, need = max(old, *lengths), live + len(rows)
        if not self._keys or need > self._keys[0].shape[0] or width - old > self._start:
            self._restore(rows[0][0], rows=need + max(4, need // 2), width=width)
        elif width > old:  # widen into the free columns on the left: padding for live rows
            self._start -= width - old
            for store in (*self._keys, *self._values):
                store[:live, :, self._start:self._start + width - old] = 0
        start, end = self._start, self._start + width
        for b, (kv, n) in enumerate(rows, start=live):
            for layer, (k, v) in enumerate(kv):
                for store, x in ((self._keys[layer], k), (self._values[layer], v)):
                    store[b, :, start:end - n] = 0
                    store[b, :, end - n:end] = x[0]
        row_masks = [F.pad(torch.ones(1, n, dtype=torch.long), (width - n, 0)) for n in lengths]
        self.mask = torch.cat([F.pad(self.mask, (width - old, 0)), *row_masks])
        self.positions = torch.cat([self.positions, torch.tensor(lengths, dtype=torch.long)])

    def row_kv(self, row: int) -> KV:
        """A copy of row `row`'s keys/values over its real columns, the last `positions[row]`
        (rows are left-padded): (1, H, P, D) per layer."""
        n = int(self.positions[row])
        return [(k[row:row + 1, :, -n:].clone(), v[row:row + 1, :, -n:].clone())
                for k, v in self.kv()]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), then trim columns that are padding everywhere.
        Only the rows that change place are copied (`compact_order` moves fewest)."""
        rows = list(rows)
        if rows == list(range(len(self))):
            return
        if not rows:
            self.__init__()  # type: ignore[misc]
            return
        moved = [b for b, row in enumerate(rows) if row != b]
        if moved:
            src, dst = torch.tensor([rows[b] for b in moved]), torch.tensor(moved)
            start, end = self._start, self._start + self.width
            for store in (*self._keys, *self._values):
                store[dst, :, start:end] = store[src, :, start:end]  # the source read first
        index = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        real_columns = self.mask.any(dim=0).nonzero()
        start = int(real_columns[0]) if len(real_columns) else self.width
        self.mask = self.mask[:, start:]
        self._start += start

    def step_kv(self) -> KV:
        """Views (B, H, S + 1, D) of every layer: the live columns and, last, the free one a
        decode step writes its keys/values into (the store grows first if it has none)."""
        if self._start + self.width == self._keys[0].shape[2]:
            self._restore(self.kv(), rows=self._keys[0].shape[0], width=self.width)
        rows, end = len(self), self._start + self.width + 1
        return [(k[:rows, :, self._start:end], v[:rows, :, self._start:end])
                for k, v in zip(self._keys, self._values, strict=True)]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask (B, S + 1), position_ids (B, 1)) for one decode step."""
        mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        return mask, self.positions.unsqueeze(1)

    def dynamic_cache(self) -> Any:
        """The live columns as a transformers `DynamicCache` for the model's own forward; its
        step's keys/values go back into the store with `commit`."""
        from transformers import DynamicCache

        return DynamicCache(self.kv())

    def commit(self, cache: Any) -> None:
        """Store the column a forward on `dynamic_cache()` appended to every layer."""
        for (keys, values), layer in zip(self.step_kv(), _layers(cache), strict=True):
            keys[:, :, -1] = layer.keys[:, :, -1]
            values[:, :, -1] = layer.values[:, :, -1]

    def advance(self) -> None:
        """Record that the decode step appended one real column to every row."""
        self.mask = torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long)], dim=1)
        self.positions = self.positions + 1


def compact_order(keep: Sequence[int]) -> list[int]:
    """`keep` (increasing row indices) in the order `PaddedKVBatch.keep` copies least: the
    rows already below `len(keep)` stay where they are, and the ones past it fill the holes
    the others left, in turn."""
    stay = {row for row in keep if row < len(keep)}
    movers = iter(row for row in keep if row >= len(keep))
    return [b if b in stay else next(movers) for b in range(len(keep))]


def prefill_inputs(prompts: list[list[int]], hits: list[PrefixHit | None]) -> dict[str, Any]:
    """Model inputs that prefill `prompts` together, each past its cached prefix (`hits`).

    One row: its new tokens, on the cached keys/values if any (exactly the single-request
    call). Several: input_ids (B, N) and position_ids (B, N) with each row's new tokens
    right-aligned; past keys/values (B, H, C, D) with each row's cached prefix right-aligned;
    attention_mask (B, C + N) marking both real spans. Pad ids and positions are 0, masked.
    """
    from transformers import DynamicCache

    cached = [hit.length if hit is not None else 0 for hit in hits]
    new = [prompt[c:] for prompt, c in zip(prompts, cached, strict=True)]
    if len(prompts) == 1:
        past = DynamicCache(hits[0].kv) if hits[0] is not None else None
        return {"input_ids": torch.tensor(new), "past_key_values": past}
    width, past_width = max(map(len, new)), max(cached)
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([[0] * (width - len(t)) + t for t in new]),
        "position_ids": torch.tensor([[0] * (width - len(t)) + list(range(c, c + len(t)))
                                      for t, c in zip(new, cached, strict=True)]),
        "attention_mask": torch.tensor([[0] * (past_width - c) + [1] * c
                                        + [0] * (width - len(t)) + [1] * len(t)
                                        for t, c in zip(new, cached, strict=True)])}
    if past_width:
        template = next(hit.kv for hit in hits if hit is not None)
        layers = []
        for layer, (k0, v0) in enumerate(template):
            keys = k0.new_zeros(len(prompts), k0.shape[1], past_width, k0.shape[3])
            values = v0.new_zeros(len(prompts), v0.shape[1], past_width, v0.shape[3])
            for b, hit in enumerate(hits):
                if hit is not None:
                    keys[b, :, past_width - hit.length:] = hit.kv[layer][0][0]
                    values[b, :, past_width - hit.length:] = hit.kv[layer][1][0]
            layers.append((keys, values))
        inputs["past_key_values"] = DynamicCache(layers)
    return inputs


def cache_kv(cache: Any) -> KV:
    """A transformers cache's keys/values per layer."""
    return [(layer.keys, layer.values) for layer in _layers(cache)]


def joined_row_kv(cache: Any, row: int, inputs: dict[str, Any]) -> KV:
    """Row `row`'s keys/values after a `prefill_inputs` forward, pads dropped: (1, H, P, D)
    per layer, in a cache of its own."""
    columns = inputs["attention_mask"][row].nonzero().squeeze(1)
    return [(layer.keys[row:row + 1].index_select(2, columns),
             layer.values[row:row + 1].index_select(2, columns)) for layer in _layers(cache)]
