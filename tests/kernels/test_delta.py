"""Lossless deltas: exact round trips both ways, verification before touching live weights,
snapshots and chain planning. Small tensors: the whole file runs in a few seconds."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kernels.delta import (
    BaseMismatchError,
    DeltaError,
    DeltaOptions,
    DeltaVerificationError,
    apply_delta,
    commit,
    encode_delta,
    encode_snapshot,
    prepare,
)
from kernels.delta.chain import ChainError, ReleaseInfo, apply_chain, plan_chain
from kernels.delta.codec import CodecOptions, decode_tensor, encode_tensor
from kernels.delta.exponent import MIN_GROUP, encode_exponent_nibble, exponents
from kernels.delta.manifest import DeltaManifest
from kernels.delta.nibble import CHUNK as NIBBLE_CHUNK
from kernels.delta.nibble import encode_nibble
from kernels.delta.state_dict import ShardReader
from kernels.delta.streams import tensor_bits, xxh3_hex
from kernels.weights import state_dict_sha256

GROUPED = CodecOptions(threads=0, group_by_exponent=True)
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40]


def _rl_step(w: torch.Tensor, lr: float, gen: torch.Generator) -> torch.Tensor:
    """What an Adam step looks like in bf16: fp32 master moved by ~lr, rounded again."""
    master = w.float() + lr * torch.randn(w.shape, generator=gen).sign()
    return master.to(w.dtype)


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(300, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "layer.0.mlp": (torch.randn(64, 200, generator=gen) * 0.05).to(torch.bfloat16),
        "layer.0.norm": torch.ones(64, dtype=torch.bfloat16),
        "layer.0.fp32": torch.randn(1000, generator=gen),
        "layer.0.fp16": torch.randn(777, generator=gen).half(),
        "layer.0.specials": torch.tensor(SPECIALS * 20, dtype=torch.bfloat16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(333, generator=gen) > 0.5,
        "codes": torch.randint(-128, 127, (500,), dtype=torch.int8, generator=gen),
    }


def _next(model: dict[str, torch.Tensor], lr: float = 1e-4, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in model.items()}
    for name in ("embed.weight", "layer.0.mlp", "layer.0.fp32", "layer.0.fp16"):
        out[name] = _rl_step(model[name], lr, gen)
    big = out["layer.0.mlp"].view(-1)
    big[:50] = torch.randn(50, generator=gen).to(torch.bfloat16) * 100  # escapes
    specials = out["layer.0.specials"].view(-1)
    specials[::3] = torch.tensor(SPECIALS * 20, dtype=torch.bfloat16).flip(0)[::3]
    out["step"] = torch.tensor(8, dtype=torch.int64)
    out["mask"] = ~model["mask"]
    out["codes"][::7] = model["codes"][::7] // 3 - 1
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(np.array_equal(tensor_bits(a[k]), tensor_bits(b[k])) for k in a)


def _copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items()}


def assert_refused_untouched(base: dict[str, torch.Tensor], manifest: DeltaManifest,
                             shard: ShardReader, *, match: str) -> None:
    """apply_delta on a copy of `base` raises DeltaVerificationError naming `match`, and the
    copy keeps every bit of `base`."""
    live = _copy(base)
    with pytest.raises(DeltaVerificationError, match=match):
        apply_delta(live, manifest, shard)
    assert _bits_equal(live, base)


@pytest.mark.parametrize("classes", [1, 2, 4])
def test_delta_round_trip_is_bit_exact_both_ways(classes: int) -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=3, target_version=4,
                           options=DeltaOptions(classes=classes))
    live = _copy(base)
    reached = apply_delta(live, release.manifest, release.shards.__getitem__)
    assert reached.version == 4 and _bits_equal(live, target)
    assert state_dict_sha256(live) == release.manifest.target.sha256
    back = apply_delta(live, release.manifest, release.shards.__getitem__)
    assert back.version == 3 and _bits_equal(live, base)


def test_codec_is_chosen_per_tensor() -> None:
    base = _model()
    target = _next(base)
    target["layer.0.fp32"] = torch.randn(1000)  # every element changes: xor wins
    release = encode_delta(base, target, base_version=0, target_version=1)
    codecs = {t.name: t.codec for t in release.manifest.tensors}
    assert codecs["layer.0.norm"] == "same"
    assert codecs["embed.weight"] == "nibble"  # lr 1e-4 moves most small weights
    # by more ulps the smaller they are: grouped by exponent where asked
    grouped = encode_delta(base, target, base_version=0, target_version=1,
                           options=DeltaOptions(group_by_exponent=True))
    assert {t.name: t.codec for t in grouped.manifest.tensors}["embed.weight"] == \
        "exponent_nibble"
    assert codecs["layer.0.fp32"] == "xor"
    live = _copy(target)
    apply_delta(live, release.manifest, release.shards.__getitem__)
    assert _bits_equal(live, base)


def test_sparse_codec_is_smaller_than_xor_on_an_rl_step() -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(200_000, generator=gen) * 0.02).to(torch.bfloat16)
    new = _rl_step(w, 1e-6, gen)
    opts = CodecOptions(threads=0)
    a, b = tensor_bits(w), tensor_bits(new)
    sparse = encode_tensor(a, b, w.dtype, opts)
    xor = encode_tensor(a, b, w.dtype, opts.model_copy(update={"try_xor_above": 0.0}))
    assert sparse.codec == "sparse"
    assert sparse.nbytes * 1.5 < xor.nbytes or xor.codec == "sparse"


@pytest.mark.parametrize("size", [1, 2, 7, 2 * NIBBLE_CHUNK + 3])
def test_nibble_codec_round_trips_both_ways_with_escapes(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    w = (torch.randn(size, generator=gen) * 0.02).to(torch.bfloat16)
    new = _rl_step(w, 1e-4, gen).view(-1)
    new[::97] = torch.randn(new[::97].shape, generator=gen).to(torch.bfloat16)  # escapes
    a, b = tensor_bits(w), tensor_bits(new)
    if size > 1000:
        assert encode_tensor(a, b, w.dtype, CodecOptions(threads=0)).codec == "nibble"
    _round_trips("nibble", encode_nibble(b - a, 3, 0), a, b, w.dtype)


def _round_trips(codec: str, streams: list[bytes], a: np.ndarray, b: np.ndarray,
                 dtype: torch.dtype) -> None:
    """`streams` take a to b forwards and b to a backwards, with the right hashes."""
    frames = [memoryview(s) for s in streams]
    for live, want, backward in ((a, b, False), (b, a, True)):
        decoded = decode_tensor(codec, frames, live, dtype, backward=backward)
        assert decoded.live_xxh3 == xxh3_hex(live) and decoded.result_xxh3 == xxh3_hex(want)
        out = live.copy()
        decoded.update.apply(out)
        assert np.array_equal(out, want)


def test_a_corrupt_nibble_stream_is_refused() -> None:
    base = {"w": (torch.randn(5000) * 0.02).to(torch.bfloat16)}
    target = {"w": _rl_step(base["w"], 1e-4, torch.Generator().manual_seed(0))}
    release = encode_delta(base, target, base_version=0, target_version=1)
    manifest = release.manifest.model_copy(deep=True)
    assert manifest.tensors[0].codec == "nibble"
    manifest.tensors[0].frames[0].length -= 1  # a truncated frame, with consistent shards
    assert_refused_untouched(base, manifest, release.shards.__getitem__, match="undecodable")


@pytest.mark.parametrize("size", [1, 7, 3 * MIN_GROUP + 5, 2 * NIBBLE_CHUNK + 3])
def test_exponent_nibble_codec_round_trips_both_ways(size: int) -> None:
    """Escapes, and crossers: weights just under a power of two whose step carries them over
    (their exponent differs between the ends, so they are coded apart from every group)."""
    gen = torch.Generator().manual_seed(size)
    w = (torch.randn(size, generator=gen) * 0.02).to(torch.bfloat16)
    w[::11] = 2.0 ** -5  # a step down crosses to the exponent below
    new = _rl_step(w, 1e-4, gen).view(-1)
    new[::97] = torch.randn(new[::97].shape, generator=gen).to(torch.bfloat16)  # escapes
    a, b = tensor_bits(w), tensor_bits(new)
    if size > 1000:
        assert (exponents(a, w.dtype) != exponents(b, w.dtype)).any()
    if size > NIBBLE_CHUNK:
        assert encode_tensor(a, b, w.dtype, GROUPED).codec == "exponent_nibble"
    _round_trips("exponent_nibble", encode_exponent_nibble(a, b - a, w.dtype, 3, 0), a, b,
                 w.dtype)


def test_a_corrupt_exponent_group_stream_is_refused() -> None:
    base = {"w": (torch.randn(50_000) * 0.02).to(torch.bfloat16)}
    target = {"w": _rl_step(base["w"], 1e-4, torch.Generator().manual_seed(0))}
    release = encode_delta(base, target, base_version=0, target_version=1,
                           options=DeltaOptions(group_by_exponent=True))
    manifest = release.manifest.model_copy(deep=True)
    assert manifest.tensors[0].codec == "exponent_nibble"
    frame = manifest.tensors[0].frames[-1]  # a group's stream
    name = manifest.shards[0].name
    blob = bytearray(release.shards[name])
    blob[frame.offset + frame.length // 2] ^= 0x5A
    shards = {name: bytes(blob)}  # a consistent shard: only the decoder can tell
    manifest.shards[0].sha256 = hashlib.sha256(shards[name]).hexdigest()
    live = _copy(base)
    with pytest.raises(DeltaVerificationError):
        apply_delta(live, manifest, shards.__getitem__)
    assert _bits_equal(live, base)


def test_a_grouped_delta_against_a_wrong_base_is_refused_as_one() -> None:
    """Its groups come from the live tensor: a wrong base makes groups that do not fit the
    streams, which is a base mismatch (the live hash is neither end), not corruption."""
    base = {"w": (torch.randn(50_000) * 0.02).to(torch.bfloat16)}
    target = {"w": _rl_step(base["w"], 1e-4, torch.Generator().manual_seed(0))}
    release = encode_delta(base, target, base_version=0, target_version=1,
                           options=DeltaOptions(group_by_exponent=True))
    assert release.manifest.tensors[0].codec == "exponent_nibble"
    other = {"w": (torch.randn(50_000) * 0.5).to(torch.bfloat16)}
    with pytest.raises(BaseMismatchError):
        apply_delta(other, release.manifest, release.shards.__getitem__)
    back = _copy(target)
    apply_delta(back, release.manifest, release.shards.__getitem__)
    assert _bits_equal(back, base)


def test_tiny_shards_round_trip() -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=0, target_version=1,
                           options=DeltaOptions(shard_bytes=97))
    assert len(release.shards) > 10
    assert all(len(s) <= 97 for s in release.shards.values())
    live = _copy(base)
    apply_delta(live, release.manifest, release.shards.__getitem__)
    assert _bits_equal(live, target)


def test_flipped_byte_in_a_shard_is_refused_and_live_untouched() -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=0, target_version=1,
                           options=DeltaOptions(shard_bytes=512))
    name = sorted(release.shards)[len(release.shards) // 2]
    corrupt = bytearray(release.shards[name])
    corrupt[len(corrupt) // 2] ^= 0x01
    shards = {**release.shards, name: bytes(corrupt)}
    assert_refused_untouched(base, release.manifest, shards.__getitem__, match=name)


def test_a_decoded_tensor_that_fails_its_hash_is_refused() -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=0, target_version=1)
    manifest = release.manifest.model_copy(deep=True)
    entry = next(t for t in manifest.tensors if t.name == "layer.0.mlp")
    entry.target_xxh3 = "0" * 32
    assert_refused_untouched(base, manifest, release.shards.__getitem__, match="layer.0.mlp")


def test_wrong_base_is_refused() -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=0, target_version=1)
    other = _next(_model(), seed=9)
    with pytest.raises(BaseMismatchError):
        apply_delta(other, release.manifest, release.shards.__getitem__)
    live = _copy(base)
    with pytest.raises(BaseMismatchError):
        prepare(live, release.manifest, release.shards.__getitem__, live_sha256="f" * 64)
    assert _bits_equal(live, base)
    live.pop("step")
    with pytest.raises(DeltaError):
        prepare(live, release.manifest, release.shards.__getitem__)


def test_prepare_leaves_live_weights_alone_until_commit() -> None:
    base, target = _model(), _next(_model())
    release = encode_delta(base, target, base_version=5, target_version=6)
    live = _copy(base)
    prepared = prepare(live, release.manifest, release.shards.__getitem__,
                       live_sha256=release.manifest.base.sha256)
    assert _bits_equal(live, base)
    assert commit(live, prepared).version == 6
    assert _bits_equal(live, target)


def test_commit_writes_in_place_into_a_model() -> None:
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    target = {k: _rl_step(v, 1e-3, torch.Generator().manual_seed(2)) for k, v in base.items()}
    release = encode_delta(base, target, base_version=0, target_version=1)
    weight = model.weight
    apply_delta(model.state_dict(), release.manifest, release.shards.__getitem__)
    assert model.weight is weight
    assert torch.equal(model.weight.detach().view(torch.int16), target["weight"].view(torch.int16))


def test_a_tied_head_sharing_the_embeddings_storage_is_written_once() -> None:
    """The nibble codec adds in place: a head tied to the embeddings (one storage, two names
    in the state dict, as transformers ties them) must get its update once, not twice."""
    base, target = _model(), _next(_model())
    gen = torch.Generator().manual_seed(3)  # one exponent: grouping gains nothing, nibble stays
    base["embed.weight"] = (1 + torch.rand(300, 64, generator=gen)).to(torch.bfloat16)
    target["embed.weight"] = _rl_step(base["embed.weight"], 1e-2, gen)
    base["lm_head.weight"], target["lm_head.weight"] = (base["embed.weight"].clone(),
                                                        target["embed.weight"].clone())
    release = encode_delta(base, target, base_version=0, target_version=1)
    codecs = {t.name: t.codec for t in release.manifest.tensors}
    assert codecs["embed.weight"] == codecs["lm_head.weight"] == "nibble"
    live = _copy(base)
    live["lm_head.weight"] = live["embed.weight"]  # tied: one storage
    apply_delta(live, release.manifest, release.shards.__getitem__)
    assert _bits_equal(live, target)


def test_snapshot_round_trip() -> None:
    weights = _next(_model())
    release = encode_snapshot(weights, version=10, options=DeltaOptions(shard_bytes=1000))
    assert {t.codec for t in release.manifest.tensors} == {"full"}
    live = {k: torch.zeros_like(v) for k, v in weights.items()}
    assert apply_delta(live, release.manifest, release.shards.__getitem__).version == 10
    assert _bits_equal(live, weights)


def test_layouts_must_match() -> None:
    base = _model()
    target = _copy(base)
    target["layer.0.fp32"] = target["layer.0.fp32"].double()
    with pytest.raises(DeltaError):
        encode_delta(base, target, base_version=0, target_version=1)


def test_state_dict_sha256_is_order_free_and_sees_dtypes() -> None:
    sd = _model()
    assert state_dict_sha256(sd) == state_dict_sha256(dict(reversed(list(sd.items()))))
    other = {**sd, "layer.0.fp32": sd["layer.0.fp32"].view(torch.int32)}
    assert state_dict_sha256(sd) != state_dict_sha256(other)


def _releases() -> list[ReleaseInfo]:
    deltas = [ReleaseInfo(version=v, kind="delta", base_version=v - 1, nbytes=10)
              for v in range(1, 8)]
    return [*deltas, ReleaseInfo(version=5, kind="snapshot", nbytes=35)]


def test_plan_chain_prefers_the_cheaper_route() -> None:
    releases = _releases()
    steps = plan_chain(4, 7, releases)
    assert [(s.release.version, s.backward) for s in steps] == [(5, False), (6, False),
                                                                (7, False)]
    far = plan_chain(0, 7, releases)
    assert [(s.release.kind, s.release.version) for s in far] == [
        ("snapshot", 5), ("delta", 6), ("delta", 7)]
    back = plan_chain(7, 5, releases)
    assert [(s.release.version, s.backward) for s in back] == [(7, True), (6, True)]
    assert [s.release.kind for s in plan_chain(None, 6, releases)] == ["snapshot", "delta"]
    assert plan_chain(3, 3, releases) == []
    assert [s.backward for s in plan_chain(None, 3, releases)] == [False, True, True]
    with pytest.raises(ChainError):
        plan_chain(None, 3, [r for r in releases if r.kind == "delta"])


def test_apply_chain_reaches_the_target() -> None:
    v0 = _model()
    v1 = _next(v0, seed=1)
    v2 = _next(v1, seed=2)
    built = {("delta", 1): encode_delta(v0, v1, base_version=0, target_version=1),
             ("delta", 2): encode_delta(v1, v2, base_version=1, target_version=2),
             ("snapshot", 2): encode_snapshot(v2, version=2)}
    infos = [ReleaseInfo.of(r.manifest) for r in built.values()]
    live = _copy(v0)
    steps = plan_chain(0, 2, infos)

    def open_release(info: ReleaseInfo):
        release = built[(info.kind, info.version)]
        return release.manifest, release.shards.__getitem__

    assert apply_chain(live, steps, open_release).version == 2
    assert _bits_equal(live, v2)
    assert apply_chain(live, plan_chain(2, 0, infos), open_release).version == 0
    assert _bits_equal(live, v0)
