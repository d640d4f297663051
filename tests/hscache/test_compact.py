"""fp8 states (``--states fp8``, hscache/store/compact.py): the codec against an independent
computation, every reader dequantising to the source dtype, the bytes, the exact slice, and the
checks (verify, the digest) covering the scales; the in-place conversion is resumable."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.cli import main
from hscache.errors import CacheFormatError, InputError
from hscache.store import compact_convert
from hscache.store.compact import (
    EXACT_ARRAY,
    SCALE_ARRAY,
    dequantise,
    dequantise_tensor,
    exact_states,
    quantise,
    relative_l2_per_layer,
)
from hscache.store.compact_convert import WORK_DIR, convert_states
from hscache.store.integrity import check_expected_digest, manifest_digest, rows_sha256, seal
from hscache.verify import verify_cache


def _reference_fp8(rows: np.ndarray) -> np.ndarray:
    """Quantise then dequantise with ml_dtypes (numpy), independently of hscache's torch code."""
    absmax = np.abs(rows).max(axis=-1, keepdims=True)
    scale = absmax / np.float32(448.0)
    q = (rows / np.where(scale > 0, scale, 1)).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * scale


def test_the_codec_matches_an_independent_fp8_and_survives_sinks_and_zero_rows():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((40, 3, 64)).astype(np.float32)
    rows[5, 1] = 0.0  # a zero row: scale 0, read back as zeros
    rows[7, :, 3] = 3000.0  # an attention-sink channel past e4m3's 448: a plain cast would saturate
    bits, scales = quantise(torch.from_numpy(rows))
    assert bits.dtype == np.uint8 and scales.shape == (40, 3) and scales.dtype == np.float32
    back = dequantise(bits, scales, torch.float32).numpy()
    np.testing.assert_array_equal(back, _reference_fp8(rows))  # the same rounding, bit for bit
    assert not back[5, 1].any()
    err = np.linalg.norm(back - rows) / np.linalg.norm(rows)
    assert err < 0.04  # e4m3's 3 mantissa bits: ~2.5% relative L2 (spec/compact.md)
    assert abs(back[7, 0, 3] - 3000.0) / 3000.0 < 0.07  # the sink keeps its value
    with pytest.raises(ValueError, match="token 2 hold NaN or inf"):
        rows[2, 0, 0] = np.inf
        quantise(torch.from_numpy(rows))


@pytest.fixture(scope="module")
def compact(small_cache, tmp_path_factory) -> tuple[Path, Path]:
    """(the small fp32 cache, a copy converted to fp8 with every 3rd-by-hash sequence exact)."""
    out = small_cache.copy(tmp_path_factory.mktemp("compact") / "fp8")
    result = CliRunner().invoke(main, ["recompress", str(out), "--states", "fp8"])
    assert result.exit_code == 0, result.output
    return small_cache.path, out


def _hidden_bytes(root: Path, names: tuple[str, ...]) -> int:
    return sum(p.stat().st_size for n in names for p in (root / "arrays" / n).rglob("c/*") if p.is_file())


def test_every_reader_gets_the_dequantised_states_in_the_source_dtype(compact):
    from hscache.data import PackedWindows, SequenceDataset
    from hscache.data.views import open_xarray
    from hscache.store.row_ranges import read_rows

    source_path, path = compact
    source, cache = hscache.open_cache(source_path), hscache.open_cache(path)
    assert cache.dtype == source.dtype == torch.float32
    raw_bits = np.asarray(cache.array("hidden_states")[: cache.num_tokens])
    raw_scales = np.asarray(cache.array(SCALE_ARRAY)[: cache.num_tokens])
    want = torch.from_numpy(_reference_fp8(np.asarray(source.array("hidden_states")[: source.num_tokens])))
    # the stored bits are the independent codec's
    np.testing.assert_array_equal(
        raw_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * raw_scales[..., None], want.numpy()
    )
    for i in range(len(cache)):
        a, b = cache.sequence_span(i)
        assert torch.equal(cache.hidden_states(i), want[a:b])
        assert max(relative_l2_per_layer(cache.hidden_states(i), source.hidden_states(i))) < 0.04
    rows = read_rows(cache, range(0, len(cache)))
    assert torch.equal(rows.data["hidden_states"], want)
    item = SequenceDataset(path, layer_ids=[5, 1])[3]
    a, b = cache.sequence_span(3)
    assert torch.equal(item["hidden_states"], want[a:b][:, [2, 0]])
    window = next(iter(PackedWindows(path, window=16, shuffle=False)))
    assert torch.equal(window["hidden_states"], want[:16])
    raw = next(iter(PackedWindows(path, window=16, shuffle=False, dequantise=False, layer_ids=[5, 3])))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states_scale"].shape == (16, 2)
    assert torch.equal(
        dequantise_tensor(raw["hidden_states"], raw["hidden_states_scale"], torch.float32),
        want[:16][:, [2, 1]],
    )
    out = torch.empty(b - a, 3, want.shape[2])
    assert cache.rows("hidden_states", a, b, out=out) is out and torch.equal(out, want[a:b])
    xr = open_xarray(path)["hidden_states"].values
    assert xr.dtype == np.float32 and np.array_equal(xr, want.numpy())


def test_states_take_a_quarter_of_fp32_and_info_says_so(compact):
    source_path, path = compact
    fp8 = _hidden_bytes(path, ("hidden_states", SCALE_ARRAY))
    assert fp8 <= 0.26 * _hidden_bytes(source_path, ("hidden_states",))  # 1 B + 4 B/H per value vs 4 B
    result = CliRunner().invoke(main, ["info", str(path), "--json"])
    summary = json.loads(result.output)
    assert summary["states"] == {"codec": "fp8", "read_as": "float32", "exact_sequences": 1}
    assert "fp8 e4m3fn" in CliRunner().invoke(main, ["info", str(path)]).output
    provenance = hscache.open_cache(path).provenance["states"]  # checked against its recorded sha256
    assert provenance["codec"] == "float8_e4m3fn" and provenance["source_dtype"] == "float32"


def test_the_exact_slice_is_the_source_bit_for_bit_and_the_rule_is_recorded(compact):
    source_path, path = compact
    source, cache = hscache.open_cache(source_path), hscache.open_cache(path)
    exact = cache.manifest["states"]["exact"]
    assert exact["seed"] == 0 and exact["every"] == compact_convert.DEFAULT_EXACT_EVERY and exact["rows"]
    for i in range(len(cache)):
        got = exact_states(cache, i)
        assert (got is None) == (i not in exact["rows"])
        if got is not None:
            assert torch.equal(got, source.hidden_states(i))


def test_verify_and_a_pinned_digest_catch_an_edited_scale(compact, tmp_path):
    import shutil

    _, path = compact
    assert verify_cache(path).ok
    pinned = manifest_digest(hscache.open_cache(path).manifest)
    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    cache = hscache.open_cache(copy)
    spec = cache.specs[SCALE_ARRAY]
    scales = np.asarray(cache.array(SCALE_ARRAY)[: spec.chunk_tokens])
    scales[3, 1] *= 2  # a consistent rewrite: zarr writes it with a valid crc32c
    import zarr

    zarr.open_array(str(copy / "arrays" / SCALE_ARRAY), mode="r+")[: spec.chunk_tokens] = scales
    report = verify_cache(copy)
    assert not report.ok and any(SCALE_ARRAY in p.message for p in report.problems), report.problems
    with pytest.raises(CacheFormatError, match=f"{SCALE_ARRAY} chunk c/0/0 .* does not match its sha256"):
        hscache.open_cache(copy).hidden_states(0)
    # resealed with the edited chunk's hash: every check passes, but the pinned digest does not
    manifest = json.loads((copy / "manifest.json").read_text())
    n = min(spec.chunk_tokens, manifest["committed"]["tokens"])
    manifest["arrays"][SCALE_ARRAY]["chunk_sha256"][0] = rows_sha256(scales[:n])
    seal(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    resealed = hscache.open_cache(copy)
    with pytest.raises(InputError, match="digest"):
        check_expected_digest(resealed, pinned, str(copy))  # what scorer eval --expect-digest runs


def test_a_damaged_fp8_chunk_is_refused_on_read(compact, tmp_path):
    """The states are decoded straight from their mapped chunk files: the crc32c still guards them."""
    import shutil

    copy = shutil.copytree(compact[1], tmp_path / "damaged")
    chunk = copy / "arrays" / "hidden_states" / "c" / "0" / "0" / "0"  # sequence 0's first chunk
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="crc32c"):
        hscache.open_cache(copy).hidden_states(0)


def test_an_edited_exact_slice_is_caught_by_verify(compact, tmp_path):
    import shutil

    _, path = compact
    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    chunk = copy / EXACT_ARRAY / "c" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    report = verify_cache(copy)
    assert not report.ok and any(EXACT_ARRAY in p.message for p in report.problems)


def test_a_conversion_killed_before_or_after_its_swap_reads_and_resumes(small_cache, tmp_path, monkeypatch):
    path = small_cache.copy(tmp_path / "cache")
    before = hscache.open_cache(path).hidden_states(2).clone()
    digest = manifest_digest(hscache.open_cache(path).manifest)

    def broken(a, b):
        raise OSError(5, "Input/output error", str(b))

    monkeypatch.setattr(compact_convert, "exchange_dirs", broken)
    with pytest.raises(hscache.StoreWriteError, match="re-run the same command to resume"):
        convert_states(path)
    cache = hscache.open_cache(path)  # killed before the swap: the source cache, as it was
    assert torch.equal(cache.hidden_states(2), before) and "states_converting" in cache.manifest
    monkeypatch.undo()
    real = compact_convert._publish_compact
    calls = []

    def dies_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device", "manifest.json")
        return real(*args)

    monkeypatch.setattr(compact_convert, "_publish_compact", dies_once)
    with pytest.raises(hscache.StoreWriteError):
        convert_states(path)  # swapped, not yet published: refused by name until the re-run
    with pytest.raises(CacheFormatError):
        hscache.open_cache(path)
    convert_states(path)
    cache = hscache.open_cache(path)
    assert "states" in cache.manifest and not (path / WORK_DIR).exists()
    assert manifest_digest(cache.manifest) != digest
    assert max(relative_l2_per_layer(cache.hidden_states(2), before)) < 0.04
    assert verify_cache(path).ok


def test_bad_requests_get_one_line(compact, tmp_path):
    _, path = compact
    for args, message in (
        (["recompress", str(path)], "say what to convert"),
        (["recompress", str(path), "--states", "source"], "the source values are gone"),
        (["recompress", str(path), "--states", "fp16"], "Invalid value for '--states'"),
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and message in result.output, result.output


def test_diff_exact_slice_reports_the_codec_error_per_layer(compact):
    from hscache.diff.codec import exact_slice_error

    source_path, path = compact
    source, cache = hscache.open_cache(source_path), hscache.open_cache(path)
    rows = cache.manifest["states"]["exact"]["rows"]
    fp8 = torch.cat([cache.hidden_states(r) for r in rows])
    exact = torch.cat([source.hidden_states(r) for r in rows])
    want = relative_l2_per_layer(fp8, exact)
    got = exact_slice_error(path)
    assert got["layer_ids"] == [1, 3, 5] and got["tokens"] == len(exact)
    np.testing.assert_allclose(got["rel_l2"], want, rtol=1e-5)  # fp32 sums in another order
    assert all(0.01 < e < 0.04 for e in want)
    result = CliRunner().invoke(main, ["diff", str(path), "--exact-slice"])
    assert result.exit_code == 0 and f"{want[0]:.2e}" in result.output
    result = CliRunner().invoke(main, ["diff", str(source_path), "--exact-slice"])
    assert result.exit_code == 2 and "is not a compact cache" in result.output


def _torch_reference(bits: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """What every reader must return: torch's fp8 -> float32 cast x the scale, rounded to ``dtype``."""
    values = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()
    return (values * torch.from_numpy(np.ascontiguousarray(scales))[..., None]).to(dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    view = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    return got.dtype == want.dtype and torch.equal(got.contiguous().view(view), want.view(view))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantise_is_torchs_fp8_cast_times_the_scale_bit_for_bit(dtype):
    every = np.arange(256, dtype=np.uint8)  # +-0, subnormals, 448 (0x7E), NaN (0x7F, 0xFF)
    finite = every[(every & 0x7F) != 0x7F]
    small = [1.0, 0.0, 1e-40, 2.0**-130, 1.5e-3, 1 / 448, 0.7, 3.0, 255.9] * 4
    # subnormal scales and products, products that round to bf16's largest finite value and past it
    scales = np.array([*small[:32], 300.0, 1e30, 3e38, 7.6e35], np.float32).reshape(-1, 2)  # [18, K 2]
    for rows in (finite, every):  # the fused kernel; a read with NaN bytes: torch's cast
        bits = np.broadcast_to(rows, (*scales.shape, len(rows))).copy()
        bits[1::2] = bits[1::2, :, ::-1]  # not the same byte order in every token
        want = _torch_reference(bits, scales, dtype)
        assert _same_bits(dequantise(bits, scales, dtype), want)
        odd = bits[:, :, :3].copy()  # an odd row size
        assert _same_bits(dequantise(odd, scales, dtype), want[:, :, :3])
        strided = torch.empty((*bits.shape[:2], 2 * bits.shape[2]), dtype=dtype)[..., ::2]
        got = dequantise(bits, scales, dtype, out=strided)  # torch's cast
        # torch's own NaN bits differ between its vectorised (0xFFFF) and strided (0x7FC0) bf16 casts
        assert _same_bits(got, want) if rows is finite else torch.equal(got.isnan(), want.isnan())
    # rows of random bytes past one vector's width, with a remainder: every lane and the loop's tail
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (5, 3, 1027), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x01
    scales = (rng.random((5, 3), dtype=np.float32) * 10.0 ** rng.integers(-6, 3, (5, 3))).astype(np.float32)
    out = torch.full(bits.shape, 7.0, dtype=dtype)
    assert dequantise(bits, scales, dtype, out=out) is out and _same_bits(
        out, _torch_reference(bits, scales, dtype)
    )
    for bad in (np.inf, -np.inf, np.nan):  # a non-finite scale: torch's cast (0 x inf is NaN)
        broken = scales.copy()
        broken[2, 1] = bad
        assert _same_bits(dequantise(bits, broken, dtype), _torch_reference(bits, broken, dtype))


def test_the_fused_kernel_decodes_clean_rows_and_hands_nan_bytes_and_bad_scales_back():
    from hscache.store.fp8_decode import decode_rows

    every = np.arange(256, dtype=np.uint8)
    finite = np.stack([every[(every & 0x7F) != 0x7F]] * 2)
    scales = np.array([0.5, 3e-3], np.float32)
    out = np.zeros(finite.shape, np.float32)
    assert decode_rows(finite, scales, out)  # the kernel decoded it, not torch's cast
    assert np.array_equal(
        out.view(np.int32), _torch_reference(finite, scales, torch.float32).view(torch.int32)
    )
    for byte in (0x7F, 0xFF):
        with_nan = finite.copy()
        with_nan[1, 17] = byte
        assert not decode_rows(with_nan, scales, out)
    assert not decode_rows(finite, np.array([1.0, np.inf], np.float32), np.zeros(finite.shape, np.uint16))
    with pytest.raises(ValueError, match="float32 or bfloat16 bits"):
        decode_rows(finite, scales, np.zeros(finite.shape, np.float64))


def test_extract_states_fp8_writes_a_compact_cache_and_a_rerun_keeps_it(tmp_path):
    config = hscache.ExtractConfig(
        out=str(tmp_path / "c"),
        layers="1,3",
        max_new_tokens=2,
        dtype="fp32",
        limit=1,
        mtp=False,
        states="fp8",
    )
    result = hscache.extract(config)
    cache = hscache.open_cache(result.path)
    assert cache.manifest["states"]["exact"]["rows"] == [0] and cache.dtype == torch.float32
    assert max(relative_l2_per_layer(cache.hidden_states(0), exact_states(cache, 0))) < 0.04
    digest = manifest_digest(cache.manifest)
    assert (
        hscache.extract(config).unchanged
        and manifest_digest(hscache.open_cache(result.path).manifest) == digest
    )
    with pytest.raises(InputError, match="convert a local cache, then upload it"):
        hscache.extract(hscache.ExtractConfig(out="s3://bucket/c", states="fp8"))
