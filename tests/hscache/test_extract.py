"""Stage one against independent computations: transformers' own forward and generate."""

from __future__ import annotations

import pytest
import torch

import hscache
from hscache.capture.target import load_target


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
        torch.testing.assert_close(
            cache.target_logsumexp(i), torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-6
        )


def test_greedy_continuation_equals_generate_and_a_naive_greedy_loop(fp32_cache):
    cache = hscache.open_cache(fp32_cache)
    target = load_target("builtin:tiny-qwen3.5", "fp32")
    row = cache.index.to_pylist()[0]
    ids = cache.token_ids(0)
    prompt = ids[: row["prompt_len"]]
    with torch.no_grad():
        generated = target.model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=12, do_sample=False
        )
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
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out),
            layers="0,1,2,3,4,5,6,7",
            max_new_tokens=12,
            dtype="fp32",
            limit=4,
            batch_tokens=100_000,
        )
    )
    single, batched = hscache.open_cache(fp32_cache), hscache.open_cache(out)
    assert single.index.column("length").to_pylist() == batched.index.column("length").to_pylist()
    for i in range(len(single)):
        assert torch.equal(single.token_ids(i), batched.token_ids(i))
        # Different batch shapes may pick different reduction orders: fp32 rounding only (the trained
        # target's states are larger than the random one's: 1 element in 63488 differed by 1.2e-5).
        torch.testing.assert_close(batched.hidden_states(i), single.hidden_states(i), rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(batched.target_topk(i)[0], single.target_topk(i)[0], rtol=1e-5, atol=1e-5)


def test_fp16_cache_keeps_fp16_states_bit_for_bit(tmp_path):
    out = tmp_path / "fp16"
    hscache.extract(
        hscache.ExtractConfig(out=str(out), layers="0,6", max_new_tokens=3, dtype="fp16", limit=1)
    )
    cache = hscache.open_cache(out)
    assert cache.dtype == torch.float16 and cache.array("hidden_states").dtype == "float16"
    target = load_target("builtin:tiny-qwen3.5", "fp16")
    out_hf = _independent_forward(target.model, cache.token_ids(0))
    assert torch.equal(cache.hidden_states(0)[:, 0], out_hf.hidden_states[1][0])
    assert torch.equal(cache.hidden_states(0)[:, 1], out_hf.hidden_states[7][0])


def test_dataset_text_after_the_prompt_is_cached_and_scored_from_the_prompt_end(tmp_path):
    from tests.conftest import write_jsonl

    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "id": "chat",
                "prompt": "Write fizzbuzz.",
                "response": " def fizzbuzz(n): return n",
                "category": "code",
            },
            {"id": "ids", "input_ids": [5, 6, 7, 8, 9, 10, 11], "prompt_len": 3},
        ],
    )
    out = tmp_path / "c"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), prompts=str(prompts), layers="1,3", max_new_tokens=0, dtype="fp32"
        )
    )
    cache = hscache.open_cache(out)
    rows = cache.index.to_pylist()
    target = load_target("builtin:tiny-qwen3.5")
    prompt_ids = target.tokenizer("Write fizzbuzz.")["input_ids"]
    response_ids = target.tokenizer(" def fizzbuzz(n): return n", add_special_tokens=False)["input_ids"]
    assert cache.token_ids(0).tolist() == prompt_ids + response_ids
    assert rows[0]["prompt_len"] == len(prompt_ids) and rows[0]["stop_reason"] == "dataset"
    assert cache.token_ids(1).tolist() == [5, 6, 7, 8, 9, 10, 11] and rows[1]["prompt_len"] == 3
    assert "response" not in cache.index.column_names and rows[0]["category"] == "code"


def test_cpu_tensors_need_no_host_copy():
    from hscache.capture.forward import to_host_async

    assert to_host_async([]) == ([], None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned async copies)")
def test_cuda_extraction_copies_through_pinned_memory(tmp_path):
    out = tmp_path / "cuda"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="1,3", max_new_tokens=4, dtype="bf16", limit=2, device="cuda", batch_tokens=1
        )
    )  # one per forward: bit-exact
    cache = hscache.open_cache(out)
    target = load_target("builtin:tiny-qwen3.5", "bf16", "cuda")
    ref = _independent_forward(target.model, cache.token_ids(0).cuda())
    assert torch.equal(cache.hidden_states(0)[:, 0], ref.hidden_states[2][0].cpu())


def test_greedy_ignores_sampling_settings_the_target_ships(tmp_path):
    """A target whose generation_config carries a repetition penalty still gets the argmax chain."""
    from hscache.capture.forward import greedy_continuation

    target = load_target("builtin:tiny-qwen3.5", "fp32")
    target.model.generation_config.repetition_penalty = 3.0
    target.model.generation_config.no_repeat_ngram_size = 1
    prompt = target.tokenizer("def fizzbuzz(n):")["input_ids"]
    ids, _ = greedy_continuation(target, prompt, 16, 4096)
    with torch.no_grad():
        naive = torch.tensor(prompt)
        for _ in range(16):
            naive = torch.cat([naive, target.model(input_ids=naive[None]).logits[0, -1].argmax()[None]])
    assert ids == naive.tolist()
    assert target.model.generation_config.repetition_penalty == 3.0  # restored
