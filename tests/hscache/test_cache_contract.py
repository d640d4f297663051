"""One contract, four cache types: the same data read through ``Cache``, ``RemoteCache``,
``ShardedCache`` and ``RowRangeView`` equals the local ``Cache`` bit for bit (after zarr-python's
StoreTests: one base class of tests, one subclass per implementation).

Every type views the session's ``scale_cache`` (4 sequences): uploaded to a moto S3 bucket,
split into 2 shards by the store's own writer (no second extraction), or read as one block.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import hscache
from hscache.store.layout import PROVENANCE, TARGET_DIR
from hscache.store.remote import RemoteCache, upload_cache
from hscache.store.row_ranges import RowRangeView, read_rows
from hscache.store.sampling import GREEDY
from hscache.store.shards import ShardedCache, shard_path
from hscache.store.writer import SequenceRows, StoreWriter

_PER_SEQUENCE = ("hidden_states", "token_ids", "target_argmax", "target_logsumexp")


def split_into_shards(source: hscache.Cache, root: Path, count: int) -> Path:
    """``source`` rewritten as the ``count`` round-robin shards ``extract --shard I/N`` would write."""
    for index in range(count):
        dest = shard_path(root, index, count)
        settings = {**source.settings, "shard": {"index": index, "count": count}}
        writer = StoreWriter.create(dest, source.specs, source.manifest["compression"], settings)
        for row in range(index, len(source), count):
            start, stop = source.sequence_span(row)
            fields = source.index.slice(row, 1).to_pylist()[0]
            writer.append(
                SequenceRows(
                    arrays={name: source.read_tokens(name, start, stop) for name in source.specs},
                    record_id=fields["record_id"],
                    prompt_len=fields["prompt_len"],
                    stop_reason=fields["stop_reason"],
                    token_sha256=fields["token_sha256"],
                    metadata_json=fields["metadata_json"],
                )
            )
        writer.finish()
        shutil.copytree(source.path / TARGET_DIR, dest / TARGET_DIR)
        shutil.copy2(source.path / PROVENANCE, dest / PROVENANCE)
        writer.record_files([TARGET_DIR, PROVENANCE])  # every file vouched for, as extract does
    return root


@pytest.fixture(scope="module")
def local(scale_cache: Path) -> hscache.Cache:
    return hscache.open_cache(scale_cache)


class CacheViewContract:
    """What every ``CacheView`` promises; a subclass supplies ``view`` (and its ``kind``)."""

    kind: type

    @pytest.fixture
    def view(self) -> hscache.CacheView:
        raise NotImplementedError

    def test_is_a_cache_view_of_its_kind(self, view):
        assert isinstance(view, hscache.CacheView) and type(view) is self.kind

    def test_sizes_layers_and_settings_equal_the_local_cache(self, view, local):
        assert (len(view), view.num_tokens, view.layer_ids) == (len(local), local.num_tokens, local.layer_ids)
        assert (view.dtype, view.complete, view.mask_token_id) == (
            local.dtype,
            local.complete,
            local.mask_token_id,
        )
        assert view.settings == local.settings and view.specs == local.specs
        # The arrays' layout; chunk hashes differ where the chunks do (shards cut the rows otherwise).
        layout = {"row_shape", "logical_dtype", "stored_dtype", "chunk_tokens"}

        def arrays(v: hscache.CacheView) -> dict:
            return {n: {k: e[k] for k in layout} for n, e in v.manifest["arrays"].items()}

        assert arrays(view) == arrays(local)
        assert view.manifest["committed"] == local.manifest["committed"]

    def test_index_equals_the_local_cache(self, view, local):
        assert view.index.column_names == local.index.column_names
        for name in local.index.column_names:
            assert view.index.column(name).to_pylist() == local.index.column(name).to_pylist(), name

    def test_every_sequence_reads_bit_for_bit(self, view, local):
        for i in range(len(local)):
            for name in _PER_SEQUENCE:
                a, b = getattr(view, name)(i), getattr(local, name)(i)
                assert a.dtype == b.dtype and torch.equal(a, b), (name, i)
            (values, ids), (ref_values, ref_ids) = view.target_topk(i), local.target_topk(i)
            assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids), i

    def test_target_files_equal_the_local_cache(self, view, local):
        head, ref = view.target_head(), local.target_head()
        assert set(head) == set(ref) and all(torch.equal(head[k], ref[k]) for k in ref)
        assert view.vocab_size == local.vocab_size and view.target_config == local.target_config
        assert {k: v for k, v in view.provenance.items() if k != "shards"} == local.provenance
        text = "The cache is data, never code."
        assert view.tokenizer()(text)["input_ids"] == local.tokenizer()(text)["input_ids"]

    def test_the_sampling_setting_is_the_local_caches(self, view, local):
        # scale_cache is greedy: the setting says temperature 0, and there is no sampled distribution.
        assert view.sampling == local.sampling == hscache.sampling_setting(view) == GREEDY
        with pytest.raises(KeyError, match="sampled_support_ids"):
            view.sampled_support(0)
        with pytest.raises(KeyError, match="sampled_token_prob"):
            view.realised_prob(0)

    def test_rows_past_the_end_and_absent_arrays_are_refused(self, view):
        with pytest.raises(IndexError, match="out of range"):
            view.hidden_states(len(view))
        with pytest.raises(KeyError, match="target_logits"):
            view.target_logits(0)  # scale_cache has no --full-logits


class TestCache(CacheViewContract):
    kind = hscache.Cache

    @pytest.fixture
    def view(self, local):
        return local


class TestRemoteCache(CacheViewContract):
    kind = RemoteCache

    @pytest.fixture(scope="class")
    def view(self, bucket, scale_cache):
        upload_cache(scale_cache, f"{bucket}/contract")
        return hscache.open_cache(f"{bucket}/contract")


class TestShardedCache(CacheViewContract):
    kind = ShardedCache

    @pytest.fixture(scope="class")
    def view(self, local, tmp_path_factory):
        root = split_into_shards(local, tmp_path_factory.mktemp("contract") / "sharded", 2)
        view = hscache.open_cache(root)
        assert [len(s) for s in view.shards] == [2, 2]
        return view


class TestBlockView(CacheViewContract):
    kind = RowRangeView

    @pytest.fixture
    def view(self, local):
        # Rows 1..2 from memory, rows 0 and 3 through the wrapped cache: both paths are checked.
        return RowRangeView(local, read_rows(local, range(1, 3)))
