"""Stage one against independent computations: transformers' own forward and generate."""

from __future__ import annotations

import pytest
import torch

import hscache
from hscache.target import load_target


def _independent_forward(model: torch.nn.Module, ids: torch.Tensor):
    with torch.no_grad():
        return model(input_ids=ids[None], output_hidden_states=True)


@pytest.mark.parametrize("cache_fixture,dtype", [("fp32_cache", "fp32"), ("bf16_cache", "bf16")])
def test_hidden_states_equal_output_hidden_states_bit_for_bit(request, cache_fixture, dtype):
    cache = hscache.open_cache(request.getfixturevalue(cache_fixture))
    target = load_target("builtin:tiny-qwen3.5", dtype)
    last = target.num_layers - 1
    for i in range(len(cache)):
        ids = cache.token_ids(i)
        out = _independent_forward(target.model, ids)
        cached = cache.hidden_states(i)
        assert cached.dtype == target.model.dtype
        for k, layer_id in enumerate(cache.layer_ids):
            if layer_id < last:
                assert torch.equal(cached[:, k], out.hidden_states[layer_id + 1][0]), (i, layer_id)
            else:
                # transformers' last entry has the final norm applied; the cache keeps the raw
                # output of the last layer, so the norm of it must reproduce that entry.
                with torch.no_grad():
                    normed = target.model.model.norm(cached[:, k])
                assert torch.equal(normed, out.hidden_states[-1][0])
                assert not torch.equal(cached[:, k], out.hidden_states[-1][0])


@pytest.mark.parametrize("cache_fixture,dtype", [("fp32_cache", "fp32"), ("bf16_cache", "bf16")])
def test_next_token_data_equals_model_logits(request, cache_fixture, dtype):
    cache = hscache.open_cache(request.getfixturevalue(cache_fixture))
    target = load_target("builtin:tiny-qwen3.5", dtype)
    k = cache.target_topk(0)[0].shape[1]
    for i in range(len(cache)):
        logits = _independent_forward(target.model, cache.token_ids(i)).logits[0]
        assert torch.equal(cache.target_argmax(i), logits.argmax(-1))
        values, ids = cache.target_topk(i)
        top = torch.topk(logits.float(), k)
        assert torch.equal(values, top.values)
        assert torch.equal(ids, top.indices)
        # exact to float32 rounding of one reduction over the vocabulary
        torch.testing.assert_close(cache.target_logsumexp(i), torch.logsumexp(logits.float(), -1),
                                   rtol=1e-6, atol=1e-6)


def test_greedy_continuation_equals_generate_and_a_naive_greedy_loop(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    row = cache.index.to_pylist()[0]
    ids = cache.token_ids(0)
    prompt = ids[: row["prompt_len"]]
    with torch.no_grad():
        generated = target.model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                          max_new_tokens=12, do_sample=False)
        naive = prompt.clone()
        for _ in range(len(ids) - len(prompt)):  # no KV cache: a full forward per token
            nxt = target.model(input_ids=naive[None]).logits[0, -1].argmax()
            naive = torch.cat([naive, nxt[None]])
    assert torch.equal(generated[0], ids)
    assert torch.equal(naive, ids)


def test_fp32_cache_lies_on_the_teacher_forced_greedy_path(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    for i, row in enumerate(cache.index.to_pylist()):
        ids, argmax, p = cache.token_ids(i), cache.target_argmax(i), row["prompt_len"]
        assert torch.equal(argmax[p - 1 : -1], ids[p:])


def test_index_columns_and_metadata(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    rows = cache.index.to_pylist()
    assert [r["record_id"] for r in rows] == ["fizzbuzz", "binary_search", "reverse_linked_list", "two_sum"]
    assert [r["category"] for r in rows] == ["code"] * 4
    offsets = [r["offset"] for r in rows]
    assert offsets == [0] + list(torch.tensor([r["length"] for r in rows]).cumsum(0)[:-1].tolist())
    assert all(r["length"] - r["prompt_len"] == 12 for r in rows)
    assert cache.layer_ids == list(range(8))
    assert cache.num_tokens == sum(r["length"] for r in rows)


def test_target_head_and_tokenizer_come_from_the_cache(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    head = cache.target_head()
    assert torch.equal(head["embed_tokens"], target.model.get_input_embeddings().weight)
    assert torch.equal(head["lm_head"], target.model.get_output_embeddings().weight)
    tok = cache.tokenizer()
    assert tok.mask_token_id == cache.mask_token_id == target.tokenizer.mask_token_id
    assert tok.decode(cache.token_ids(0)) == target.tokenizer.decode(cache.token_ids(0))
    assert cache.target_config["model_type"] == "qwen3_5_text"


def test_batched_forward_matches_one_sequence_per_forward_and_padding_does_not_leak(fp32_cache, tmp_path):
    out = tmp_path / "batched"
    hscache.extract(hscache.ExtractConfig(out=str(out), layers="0,1,2,3,4,5,6,7", max_new_tokens=12,
                                          dtype="fp32", limit=4, batch_tokens=100_000))
    single, batched = hscache.open_cache(fp32_cache), hscache.open_cache(out)
    assert single.index.column("length").to_pylist() == batched.index.column("length").to_pylist()
    for i in range(len(single)):
        assert torch.equal(single.token_ids(i), batched.token_ids(i))
        # Different batch shapes may pick different reduction orders: fp32 rounding only.
        torch.testing.assert_close(batched.hidden_states(i), single.hidden_states(i), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.target_topk(i)[0], single.target_topk(i)[0], rtol=1e-5, atol=1e-5)
