"""A left-padded batch KV cache that rows join and leave between decode steps.

Continuous batching: every active request is one row of per-layer keys/values (B, H, S, D),
left-padded to a common length S, in a store with spare columns that decode steps write into in
place (serving/decode.py's lean step, or Hugging Face's forward on a `DynamicCache` view).
`mask` (B, S) marks real columns; `positions` (B,) is each row's next position id, so RoPE sees
true positions whatever the padding. A new row (its own prefill cache, no padding) joins by
left-padding whichever side is shorter; finished rows leave with `index_select`; columns that
are padding in every remaining row are trimmed off the left. Padded keys/values are zeros and
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


def _left_pad(x: torch.Tensor, columns: int) -> torch.Tensor:
    """Pad (B, H, S, D) with `columns` zero columns on the left of S."""
    return F.pad(x, (0, 0, columns, 0)) if columns else x


def _spare(width: int) -> int:
    """Free columns a new store keeps after `width` live ones: decode steps write there in
    place until it fills (then the store is copied once into a bigger one)."""
    return max(64, width // 2)


class PaddedKVBatch:
    """The shared cache of all active rows (see module doc). Rows are indexed 0..B-1.

    Each layer's keys and values live in a store (B, H, C, D) with C >= the live width: the
    live columns are `[start, start + width)`, a decode step writes its column right after
    them in place (`step_kv`), and trimming the left is moving `start`. The store is copied
    only when rows join or leave, or when its spare columns run out."""

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
        end = self._start + self.width
        return [(k[:, :, self._start:end], v[:, :, self._start:end])
                for k, v in zip(self._keys, self._values, strict=True)]

    def _restore(self, kv: KV, spare: int) -> None:
        """Copy `kv` (live columns only) into a new store with `spare` free columns."""
        self._keys, self._values, self._start = [], [], 0
        for keys, values in kv:
            b, h, s, d = keys.shape
            self._keys.append(keys.new_zeros(b, h, s + spare, d))
            self._values.append(values.new_zeros(b, h, s + spare, d))
            self._keys[-1][:, :, :s] = keys
            self._values[-1][:, :, :s] = values

    def add(self, row_kv: KV, length: int) -> None:
        """Append one row: `row_kv` per layer (1, H, length, D), all real tokens."""
        self.extend([(row_kv, length)])

    def extend(self, rows: Sequence[tuple[KV, int]]) -> None:
        """Append rows, each (per-layer keys/values (1, H, n, D), n real tokens), copying the
        batch once."""
        if not rows:
            return
        lengths = [length for _, length in rows]
        parts = list(rows)
        if len(self):
            parts.insert(0, (self.kv(), self.width))
        width = max(length for _, length in parts)
        joined = [(torch.cat([_left_pad(kv[i][0], width - n) for kv, n in parts]),
                   torch.cat([_left_pad(kv[i][1], width - n) for kv, n in parts]))
                  for i in range(len(parts[0][0]))]
        self._restore(joined, _spare(width))
        row_masks = [F.pad(torch.ones(1, n, dtype=torch.long), (width - n, 0)) for n in lengths]
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), *row_masks])
        self.positions = torch.cat([self.positions, torch.tensor(lengths, dtype=torch.long)])

    def row_kv(self, row: int) -> KV:
        """A copy of row `row`'s keys/values over its real columns, the last `positions[row]`
        (rows are left-padded): (1, H, P, D) per layer."""
        n = int(self.positions[row])
        return [(k[row:row + 1, :, -n:].clone(), v[row:row + 1, :, -n:].clone())
                for k, v in self.kv()]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), then trim columns that are padding everywhere."""
        if len(rows) == len(self) and list(rows) == list(range(len(self))):
            return
        if not rows:
            self.__init__()  # type: ignore[misc]
            return
        index = torch.tensor(list(rows), dtype=torch.long)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        real_columns = self.mask.any(dim=0).nonzero()
        start = int(real_columns[0]) if len(real_columns) else self.width
        self.mask = self.mask[:, start:]
        self._start += start
        self._keys = [k.index_select(0, index) for k in self._keys]
        self._values = [v.index_select(0, index) for v in self._values]

    def step_kv(self) -> KV:
        """Views (B, H, S + 1, D) of every layer: the live columns and, last, the free one a
        decode step writes its keys/values into (the store grows first if it has none)."""
        if self._start + self.width == self._keys[0].shape[2]:
            self._restore(self.kv(), _spare(self.width))
        end = self._start + self.width + 1
        return [(k[:, :, self._start:end], v[:, :, self._start:end])
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
