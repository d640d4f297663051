"""DSpark (scorer/families/dspark/): drafts equal a replay through speculators' own DSparkDraftModel
(its class, its saver), vLLM's sequential Markov walk transcribed (qwen3_dspark.py,
v1/worker/gpu/spec_decode/dspark/speculator.py), and ``scorer init --family dspark`` writes what
vLLM's config reads as a Qwen3 DSpark drafter.

The peers run from ``.peers/`` (``pip install --no-deps --target .peers speculators==0.9.0``; NeMo Automodel
and SpecForge as tests/scorer/nemo_peer.py and test_eagle3_peers.py install them), speculators'
training-data imports stubbed, as in test_eagle3_peers.py (whose ``peers`` fixture this reuses). CPU:
~3 s (the peer import is shared with test_eagle3_peers.py when both run).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import hscache
from scorer.errors import CheckpointError
from scorer.families.dflash.score import draft_all_anchors
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, evaluate, load_drafter
from tests.scorer.family_contract import FamilyContract
from tests.scorer.nemo_peer import nemo_module
from tests.scorer.test_eagle3_peers import greedy_speculators_config, peers  # noqa: F401  (the shared peer fixture)

N = 4  # drafted tokens per round: speculators' block_size in the anchor layout
RANK = 8


def _speculators_dspark(peers, cache, *, anchor: bool, draft_vocab: int | None = None):  # noqa: F811
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from transformers import Qwen3Config

    vocab = cache.vocab_size
    layer = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    layer._attn_implementation = "eager"
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab or vocab,
        block_size=N if anchor else N + 1,
        aux_hidden_state_layer_ids=[2, 4, 8],  # vLLM aux ids: this project's layers 1, 3, 7
        mask_token_id=cache.mask_token_id,
        sample_from_anchor=anchor,
        markov_rank=RANK,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        speculators_config=greedy_speculators_config(peers, "dspark", N),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DSparkDraftModel(config).eval()
        head = cache.target_head()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name == "embed_tokens.weight":
                    param.copy_(head["embed_tokens"])
                elif name == "lm_head.weight" and draft_vocab is None:
                    param.copy_(head["lm_head"])
                elif "markov" in name:
                    param.normal_(0, 0.5)  # a bias that moves the drafts
                elif param.ndim == 2:
                    param.normal_(0, 0.25)
                else:
                    param.uniform_(0.8, 1.2)
            if draft_vocab is not None:  # every other target id, as speculators' sorted reduced vocabulary
                ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
                model.d2t.copy_(ids - torch.arange(draft_vocab))
                model.t2d.zero_()
                model.t2d[ids] = True
    return model


def _their_drafts(
    model, features, tokens, anchor: int, *, anchor_layout: bool
) -> tuple[list[int], list[float]]:
    """speculators' modules on one block at ``anchor`` (its training forward for one anchor: queries see
    the context before the anchor and their whole block, ``_backbone_forward``), then vLLM's greedy
    Markov walk over its logits with speculators' own MarkovHead and ConfidenceHead."""
    width = N if anchor_layout else N + 1
    block = torch.full((1, width), model.mask_token_id, dtype=torch.long)
    block[0, 0] = tokens[anchor]
    with torch.no_grad():
        context = model.hidden_norm(model.fc(features[None, :anchor]))
        positions = torch.arange(anchor + width)[None]
        embeddings = model.rotary_emb(context, positions)
        h = model.embed_tokens(block)
        for layer in model.layers:
            h = layer(
                hidden_states=h, target_hidden=context, attention_mask=None, position_ids=positions,
                use_cache=False, position_embeddings=embeddings,
            )  # fmt: skip
        hidden = model.norm(h)[0, 0 if anchor_layout else 1 :]
        logits = model.lm_head(hidden)
        prev, drafts, embeds = tokens[anchor : anchor + 1], [], []
        for slot in range(N):
            embed = model.markov_head.prev_embeddings(prev)
            embeds.append(embed[0])
            corrected = logits[slot] + model.markov_head.markov_w2(embed)[0]
            prev = corrected.argmax(-1, keepdim=True)
            if model.d2t is not None:  # a draft id to its target id (vLLM map_draft_to_target)
                prev = prev + model.d2t[prev]
            drafts.append(int(prev))
        conf = torch.sigmoid(model.confidence_head(torch.cat([hidden, torch.stack(embeds)], dim=-1)))
    return drafts, conf.tolist()


@pytest.mark.parametrize("anchor_layout, reduced", [(True, False), (False, False), (True, True)])
def test_speculators_dspark_drafts_like_its_modules(peers, scorer_cache, tmp_path, anchor_layout, reduced):  # noqa: F811
    """Both layouts, and a reduced draft vocabulary (its own lm_head, d2t: the Markov bias lives in draft
    space, qwen3_dspark.py:273-282, the walk's predecessor is the mapped target id)."""
    cache = hscache.open_cache(scorer_cache)
    model = _speculators_dspark(
        peers, cache, anchor=anchor_layout, draft_vocab=cache.vocab_size // 2 if reduced else None
    )
    model.save_pretrained(str(tmp_path / "speculators"))
    saved = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert saved["speculators_model_type"] == "dspark" and saved["sample_from_anchor"] is anchor_layout

    drafter, loaded = load_drafter(tmp_path / "speculators", cache, EvalConfig(ddtree=()))
    assert drafter.family == "dspark" and loaded.report.layout == "speculators"
    assert drafter.config.num_draft_tokens == N and drafter.config.target_layer_ids == (1, 3, 7)
    features, tokens, anchors, ours = _drafted(cache, drafter)
    for n in range(0, len(anchors), 3):
        theirs, conf = _their_drafts(model, features, tokens, anchors[n], anchor_layout=anchor_layout)
        assert ours[n].tolist() == theirs, anchors[n]
        # the confidence head, read as vLLM reads it (rows and the walk's predecessors)
        block = torch.full((1, N + 1), drafter.config.mask_token_id, dtype=torch.long)
        block[0, 0] = tokens[anchors[n]]
        rows = drafter.block_hidden(features, torch.tensor([anchors[n]]), block)[0]
        prev = torch.tensor([int(tokens[anchors[n]]), *theirs[:-1]])
        np.testing.assert_allclose(drafter.confidence(rows, prev).tolist(), conf, rtol=1e-5, atol=1e-6)
    # the Markov head moves the drafts: they are not each slot's own argmax everywhere
    plain = drafter.head(
        drafter.block_hidden(features, torch.tensor(anchors), _blocks(drafter, tokens, anchors))
    ).argmax(-1)
    assert (plain.numpy() != ours).any() and len(np.unique(ours)) > 3


def _drafted(cache, drafter, row: int = 1):
    """Row ``row``'s features, tokens, anchors P..T-2 and the scorer's drafts there."""
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", None)
    tokens = cache.token_ids(row).long()
    prompt_len = cache.index.column("prompt_len")[row].as_py()
    ours, _, _ = draft_all_anchors(drafter, features, tokens, prompt_len, tree_k=0)
    return features, tokens, list(range(prompt_len, len(tokens) - 1)), ours


def _blocks(drafter, tokens, anchors):
    blocks = torch.full((len(anchors), drafter.config.block_size), drafter.config.mask_token_id)
    blocks[:, 0] = tokens[torch.tensor(anchors)]
    return blocks


def test_dspark_topk_walks_the_corrected_candidates(peers, scorer_cache, tmp_path):  # noqa: F811
    """``dspark_draft_topk`` (speculator.py:201-248): the walk over each slot's top-k base logits
    corrected by the Markov bias equals the full walk restricted to those candidates."""
    cache = hscache.open_cache(scorer_cache)
    model = _speculators_dspark(peers, cache, anchor=True)
    model.save_pretrained(str(tmp_path / "s"))
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    config["dspark_draft_topk"] = 2
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    drafter, _ = load_drafter(tmp_path / "s", cache, EvalConfig(ddtree=()))
    assert drafter.config.dspark_draft_topk == 2
    features, tokens, anchors, ours = _drafted(cache, drafter)
    hidden = drafter.block_hidden(features, torch.tensor(anchors), _blocks(drafter, tokens, anchors))
    logits = drafter.head(hidden)
    for n, anchor in enumerate(anchors):
        prev = tokens[anchor : anchor + 1]
        for slot in range(N):
            top = logits[n, slot].topk(2)
            corrected = top.values + drafter.markov_bias(prev)[0, top.indices]
            prev = top.indices[corrected.argmax()].reshape(1)
            assert int(prev) == ours[n, slot]


def test_dspark_init_writes_what_vllm_reads_and_scores(scorer_cache, tmp_path):
    """``scorer init --family dspark`` writes the dense layout (vLLM config/speculative.py:1342-1355
    detects ``Qwen3DSparkModel``; qwen3_dspark.py:205-230 reads markov_rank and the confidence keys at
    top level; dflash/speculator.py:77-85 refuses sample_from_anchor inside dflash_config) and the
    scorer reads it back: N drafts from a block of N rows, every row drafting."""
    from scorer.families import family_named

    out = tmp_path / "dspark"
    family_named("dspark").init(scorer_cache, out, block_size=N + 1, markov_rank=RANK)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == N
    assert config["markov_rank"] == RANK and config["sample_from_anchor"] is True
    assert "sample_from_anchor" not in config["dflash_config"]
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.bias",
    } <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)  # vLLM shares the target's
    report = evaluate(out, scorer_cache, EvalConfig(n_boot=10, limit=1))
    assert report["drafter"]["family"] == "dspark" and report["config"]["ddtree"] == []
    drafter, _ = load_drafter(out, hscache.open_cache(scorer_cache), EvalConfig())
    assert drafter.first_draft_slot == 0 and drafter.config.block_size == N + 1


def test_dspark_bad_checkpoints_are_refused_by_name(scorer_cache, tmp_path):
    from scorer.families import family_named

    out = tmp_path / "d"
    family_named("dspark").init(scorer_cache, out, block_size=N + 1, markov_rank=RANK)
    cache = hscache.open_cache(scorer_cache)
    config = json.loads((out / "config.json").read_text())
    for key, value, said in (
        ("markov_head_type", "gated", "vanilla Markov head only"),
        ("dspark_draft_topk", 10**6, "dspark_draft_topk"),
        ("markov_rank", 0, "markov_rank 0"),
    ):
        (out / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(CheckpointError, match=said):
            load_drafter(out, cache, EvalConfig())


def test_dspark_probabilistic_proposals_feed_the_trajectory(scorer_cache, tmp_path):
    """The probabilistic rule's q (spec/sampling.md 4.3): slot j proposes from softmax((base_j +
    bias(y_{a+j-1})) / T), the anchor token for slot 1; checked against the head computed directly."""
    from scorer.families import family_named
    from scorer.families.dflash.proposals import block_log_q

    out = tmp_path / "d"
    family_named("dspark").init(scorer_cache, out, block_size=N + 1, markov_rank=RANK)
    cache = hscache.open_cache(scorer_cache)
    drafter, _ = load_drafter(out, cache, EvalConfig())
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 1.0)
    row, temperature = 0, 0.7
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", drafter.context_norm)
    tokens = cache.token_ids(row).long()
    prompt_len = cache.index.column("prompt_len")[row].as_py()
    draft, log_q = block_log_q(drafter, features, tokens, prompt_len, temperature)
    a = prompt_len + 1
    block = torch.full((1, N + 1), drafter.config.mask_token_id)
    block[0, 0] = tokens[a]
    rows = drafter.block_hidden(features, torch.tensor([a]), block)[0]
    for j in range(min(N, len(tokens) - 1 - a)):
        with torch.no_grad():
            scores = drafter.head(rows[j]).float() + drafter.markov_bias(tokens[a + j : a + j + 1])[0]
        want = torch.log_softmax(scores / temperature, -1)[tokens[a + j + 1]]
        np.testing.assert_allclose(log_q[a - prompt_len, j], float(want), rtol=1e-6)  # fp32
        assert draft[a - prompt_len, j] == int(scores.argmax())


def test_adaptive_budget_is_vllms_argmax_over_stale_survival():
    """adaptive_verification.py:303-359: n maximising (1 + sum of the first n survival probabilities) /
    (round cost + 1 + n), from the PREVIOUS round's confidences (the first round's all 1.0). Worked by
    hand: confidences .9, .9, .1, .1 at cost 2 give .5, .633, .678, .558, .467 for n = 0..4: n = 2."""
    from scorer.families.dspark.adaptive import draft_budget

    assert draft_budget([0.9, 0.9, 0.1, 0.1], 4, 2.0) == 2
    assert draft_budget([0.9, 0.9, 0.1, 0.1], 4, 0.0) == 0  # a round costs no more than its token: decode
    assert draft_budget([1.0] * 4, 4, 2.0) == 4  # a new request: every draft
    rounds = ([0.9, 0.9, 0.1, 0.1], [0.5, 0.5, 0.5, 0.5], [1.0] * 4)  # three rounds' confidences
    stale = ([1.0] * 4, *rounds[:-1])  # each round's budget reads the round before's (1.0 first)
    assert [draft_budget(c, 4, 2.0) for c in stale] == [4, 2, 1]
    # off by one round (each round's own confidences) verifies otherwise
    assert [draft_budget(c, 4, 2.0) for c in rounds] == [2, 1, 4]


def test_scorer_eval_replays_the_adaptive_budget_per_round(scorer_cache, tmp_path):
    """``--adaptive-verification C``: every round accepts min(its leading match, the budget of the
    previous round's confidences); without a confidence head, and online, it is refused by name."""
    from scorer.families import family_named
    from scorer.families.dspark.adaptive import draft_budget
    from scorer.families.dspark.adaptive_replay import anchor_confidences
    from scorer.rules.onehot_chain import leading_matches, slot_matches

    out = tmp_path / "d"
    family_named("dspark").init(scorer_cache, out, block_size=N + 1, markov_rank=RANK)
    cache = hscache.open_cache(scorer_cache)
    config = EvalConfig(ddtree=(), n_boot=10, limit=2, overrides={"adaptive_verification": 1.0})
    report = evaluate(out, scorer_cache, config)
    assert report["family_metrics"]["adaptive_budget"]["value"] < N  # the budget cut some rounds
    drafter, _ = load_drafter(out, cache, config)
    for row, request in enumerate(report["per_request"]):
        index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
        features = sequence_features(
            cache.hidden_states(row), index, torch.float32, "cpu", drafter.context_norm
        )
        tokens, P = cache.token_ids(row).long(), cache.index.column("prompt_len")[row].as_py()
        drafts, _, _ = draft_all_anchors(drafter, features, tokens, P, tree_k=0)
        conf = anchor_confidences(drafter, features, tokens, P, drafts)
        lead = leading_matches(slot_matches(drafts, tokens.numpy(), cache.target_argmax(row).numpy(), P)[0])
        stale = [1.0] * N
        for anchor, accepted in zip(request["anchors"], request["accepted"], strict=True):
            budget = draft_budget(stale, N, 1.0)
            assert accepted == min(int(lead[anchor - P]), budget, len(tokens) - 1 - anchor)
            stale = conf[anchor - P]
    plain = tmp_path / "plain"
    family_named("dspark").init(scorer_cache, plain, block_size=N + 1, markov_rank=RANK)
    hf = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**hf, "enable_confidence_head": False}))
    with pytest.raises(CheckpointError, match="confidence head"):
        load_drafter(plain, cache, config)


def test_dspark_trains_its_markov_and_confidence_heads(scorer_cache, tmp_path):
    """``scorer init --family dspark --train-steps N``: DFlash's trainer with the Markov bias of each slot's
    teacher-forced predecessor in the logits and the confidence head's BCE (gradients reach both heads);
    saved in the dense layout, scored as a DSpark drafter."""
    from scorer.families import family_named

    family = family_named("dspark")
    out = tmp_path / "trained"
    result = family.train(scorer_cache, out, steps=6, block_size=N + 1, anchors_per_step=8, markov_rank=RANK)
    assert np.isfinite(result["final_loss"]) and result["config"].markov_rank == RANK
    start = tmp_path / "start"  # the trainer's seed, without steps: its heads as initialised
    family.train(scorer_cache, start, steps=0, block_size=N + 1, markov_rank=RANK)
    from safetensors.torch import load_file

    trained, initial = load_file(str(out / "model.safetensors")), load_file(str(start / "model.safetensors"))
    for key in ("markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert not torch.equal(trained[key], initial[key]), key
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    drafter, _ = load_drafter(out, hscache.open_cache(scorer_cache), EvalConfig())
    assert drafter.family == "dspark" and drafter.confidence_head is not None


def _seeded_peer(build):
    """A peer's DSpark module from ``build`` under seed 0, in eval mode, its weights large enough (the Markov
    head's most) that the context and the walk move the drafts."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "markov" in name:
                    param.normal_(0, 0.5)
                elif param.ndim == 2:
                    param.normal_(0, 0.25)
                else:
                    param.uniform_(0.8, 1.2)
    return model


def test_specforge_dspark_export_drafts_like_its_modules(peers, scorer_cache, tmp_path):  # noqa: F811
    """SpecForge 0.2's ``DSparkDraftModel`` (modeling/draft/dspark.py): DFlash's fill-in block (the anchor a
    bonus token, ``_sample_draft_tokens`` reads rows 1..B-1) and its Markov keys in dflash_config. Its
    export has no top-level ``sample_from_anchor``, which vLLM reads as True (dspark/speculator.py:49-51):
    served, every row drafts from a block one row shorter than SpecForge trained; the scorer reads it so.
    With ``sample_from_anchor: false`` written, the drafts equal SpecForge's own forward and Markov walk."""
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import Qwen3Config

    cache = hscache.open_cache(scorer_cache)
    B = N + 1
    config = Qwen3Config(
        vocab_size=cache.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        block_size=B, num_target_layers=8,
        dflash_config={
            "mask_token_id": cache.mask_token_id, "target_layer_ids": [1, 3, 7], "markov_rank": RANK,
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
        },
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = _seeded_peer(lambda: DSparkDraftModel(config))
    model.save_pretrained(str(tmp_path / "specforge"))
    drafter, _ = load_drafter(tmp_path / "specforge", cache, EvalConfig(ddtree=()))
    assert drafter.family == "dspark" and drafter.first_draft_slot == 0  # as vLLM serves the export
    written = json.loads((tmp_path / "specforge" / "config.json").read_text())
    (tmp_path / "specforge" / "config.json").write_text(json.dumps({**written, "sample_from_anchor": False}))
    drafter, _ = load_drafter(tmp_path / "specforge", cache, EvalConfig(ddtree=()))
    assert drafter.first_draft_slot == 1 and drafter.config.num_draft_tokens == N

    row = 1
    features = sequence_features(cache.hidden_states(row), [0, 1, 2], torch.float32, "cpu", None)
    tokens = cache.token_ids(row).long()
    prompt_len = cache.index.column("prompt_len")[row].as_py()
    ours, _, _ = draft_all_anchors(drafter, features, tokens, prompt_len, tree_k=0)
    head = cache.target_head()
    anchors = list(range(prompt_len, len(tokens) - 1))
    for n in range(0, len(anchors), 3):
        p = anchors[n]
        block = torch.full((1, B), model.mask_token_id, dtype=torch.long)
        block[0, 0] = tokens[p]
        with torch.no_grad():
            hidden = model(
                position_ids=torch.arange(p + B)[None],
                noise_embedding=torch.nn.functional.embedding(block, head["embed_tokens"]),
                target_hidden=features[None, :p],
            )[:, -B + 1 :]
            base = hidden @ head["lm_head"].T
            theirs, _ = model.markov_head.sample_block_tokens(
                base, first_prev_token_ids=block[:, 0], hidden_states=hidden
            )
        assert ours[n].tolist() == theirs[0].tolist(), p


def test_nemo_dspark_checkpoint_drafts_like_its_training_forward(scorer_cache, tmp_path, monkeypatch):
    """NeMo Automodel 0.7's ``Qwen3DSparkModel`` (components/speculative/dspark/draft_qwen3.py), configured
    as its recipe writes it (recipes/llm/train_dspark.py:1066-1083: the target's config plus top-level
    ``target_layer_ids``, ``block_size``, ``mask_token_id``, Markov and confidence keys, its own frozen copies
    of the target's embedding and head) and saved with its ``save_pretrained``: vLLM's dense layout, whose
    absent ``sample_from_anchor`` vLLM reads as True, as NeMo trains (the anchor row drafts too). Every
    anchor's N drafts equal NeMo's training forward run over every anchor (``sample_anchor_positions``
    replaced; its block rows caught after the final norm) and walked by its ``sample_draft_tokens``; the
    confidences equal its ``predict_confidence_step`` on those rows."""
    from transformers import Qwen3Config

    nemo = nemo_module("nemo_automodel.components.speculative.dspark.draft_qwen3")
    cache = hscache.open_cache(scorer_cache)
    head = cache.target_head()
    config = Qwen3Config(
        vocab_size=cache.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        architectures=["Qwen3DSparkModel"], num_target_layers=8, target_layer_ids=[1, 3, 7], block_size=N,
        num_anchors=8, mask_token_id=cache.mask_token_id, markov_rank=RANK, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = _seeded_peer(lambda: nemo.Qwen3DSparkModel(config).float())
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head["embed_tokens"])  # NeMo seeds both from the target
        model.lm_head.weight.copy_(head["lm_head"])
    model.save_pretrained(str(tmp_path / "nemo"))
    drafter, loaded = load_drafter(tmp_path / "nemo", cache, EvalConfig(ddtree=()))
    assert (
        drafter.family == "dspark" and drafter.first_draft_slot == 0 and drafter.config.num_draft_tokens == N
    )
    assert drafter.config.target_layer_ids == (1, 3, 7) and drafter.confidence_head is not None

    row = 1
    features = sequence_features(cache.hidden_states(row), [0, 1, 2], torch.float32, "cpu", None)
    tokens = cache.token_ids(row).long()
    prompt_len = cache.index.column("prompt_len")[row].as_py()
    ours, _, _ = draft_all_anchors(drafter, features, tokens, prompt_len, tree_k=0)
    anchors = torch.arange(prompt_len, len(tokens) - 1)[None]
    monkeypatch.setattr(
        nemo, "sample_anchor_positions", lambda **_: (anchors, torch.ones_like(anchors).bool())
    )
    caught = []
    model.norm.register_forward_hook(lambda _m, _i, out: caught.append(out))
    seq = len(tokens)
    with torch.no_grad():
        model(
            input_ids=tokens[None], target_hidden_states=features[None], loss_mask=torch.ones(1, seq).long()
        )
        hidden = caught[0].view(anchors.shape[1], N, -1)
        theirs, _ = model.sample_draft_tokens(
            model.compute_logits(hidden), first_prev_token_ids=tokens[anchors[0]], hidden_states=hidden
        )
        prev = torch.cat([tokens[anchors[0], None], theirs[:, :-1]], dim=1)
        confidence = torch.sigmoid(model.predict_confidence_step(hidden, prev_token_ids=prev))
        mine = drafter.confidence(hidden.reshape(-1, hidden.shape[-1]), prev.reshape(-1)).view_as(confidence)
    valid = ours >= 0
    assert valid.sum() > 3 * len(ours) and len(np.unique(ours)) > 3
    np.testing.assert_array_equal(ours[valid], theirs.numpy()[valid])
    torch.testing.assert_close(mine.float(), confidence, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def dspark_drafter(scorer_cache, tmp_path_factory):
    """``scorer init --family dspark`` on the session cache, its Markov head made strong enough to move
    the drafts (a random head at init's scale barely does)."""
    from safetensors.torch import load_file, save_file

    from scorer.families import family_named

    out = tmp_path_factory.mktemp("dspark") / "d"
    family_named("dspark").init(scorer_cache, out, block_size=N + 1, markov_rank=RANK)
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        tensors[key] = torch.randn(tensors[key].shape, generator=gen)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


class TestDSparkContract(FamilyContract):
    """The family contract (tests/scorer/family_contract.py) on a DSpark drafter: online == offline round
    for round (the online proposer walks the Markov head from the same anchor tokens), refusals, the
    target identity, compare pairing, cost keys and the timed round."""

    family = "dspark"

    @pytest.fixture
    def checkpoint(self, dspark_drafter):
        return dspark_drafter
