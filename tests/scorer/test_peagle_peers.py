"""P-EAGLE written by speculators 0.9 (its ``PEagleDraftModel`` and saver) and by SpecForge 0.2 (its
``PEagleDraftModel``, saved as its HF export saves it) loads as the peagle family and drafts, at every anchor
and parallel slot, what the peer's own forward predicts there.

Both peers' forwards are their TRAINING forwards: COD sampling draws which (anchor, depth) rows they run; here
they are made to run all of them (``generate_cod_sample_indices`` replaced by every anchor x depth < K), and
the drafts are read off their ``lm_head``. Their rows are vLLM's: depth 0 at anchor a is step 0's row (target
state a, token a+1, position a), depth d the mask token and ``mask_hidden`` at position a+d, attending to the
depth-0 rows up to a and to its own rollout (``create_peagle_mask_mod``, the same in both). The ``peers``
fixture (.peers, stubs) is test_eagle3_peers.py's."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from test_eagle3_peers import K, greedy_speculators_config, peers, randomize_with_draft_vocab  # noqa: F401  (the fixture, used by name)

import hscache
from scorer.families.eagle3.drafting import draft_every_anchor
from scorer.offline.scoring import EvalConfig, load_drafter
from scorer.offline.sequences import sequence_features
from tests.scorer.nemo_peer import nemo_module

MASK = 7


def _our_drafts(drafter, cache, row: int = 1):
    """(features of the layers vLLM serves the drafter, token ids, prompt length, the replay's drafts
    [anchors, K]) of cached sequence ``row``."""
    index = [cache.layer_ids.index(i) for i in drafter.config.layer_ids_served_by("vllm")]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", None)
    tokens, prompt_len = cache.token_ids(row).long(), int(cache.index.column("prompt_len")[row].as_py())
    return features, tokens, prompt_len, draft_every_anchor(drafter, features, tokens, prompt_len, K)


def _every_anchor_and_depth(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """COD's (anchor, depth) indices with nothing sampled away: every anchor x depth < K, depth-major."""
    anchor = torch.cat([torch.arange(rows - d) for d in range(K)])
    depth = torch.cat([torch.full((rows - d,), d) for d in range(K)])
    return anchor, depth


def _assert_same_as_peer(
    drafter, features, tokens, prompt_len, ours, anchor, depth, logits, d2t=None
) -> None:
    """The peer's COD rows (a, d) are anchor p = a + 1, slot d + 1: its drafts (the argmax of its draft-
    vocabulary ``logits`` [rows, Vd], as target ids) equal the replay's ``ours`` [anchors, K] wherever both
    exist, and its logits equal the literal one-forward first pass's (``draft_one_anchor``, which
    test_peagle.py checks against the replay) within 1e-4 (fp32, another attention kernel and order)."""
    ids = torch.arange(logits.shape[-1]) + (0 if d2t is None else d2t)  # draft id -> target id
    drafted = ids[logits.argmax(-1)].numpy()
    theirs = np.full_like(ours, -1)
    for a, d, token in zip(anchor.tolist(), depth.tolist(), drafted):
        if a >= prompt_len - 1:
            theirs[a - (prompt_len - 1), d] = token
    valid = theirs >= 0
    assert valid.sum() >= 30 and len(np.unique(ours[:, 1:])) > 1  # the mask slots' drafts vary
    np.testing.assert_array_equal(ours[valid], theirs[valid])
    mine = {}
    for p in range(prompt_len, int(anchor.max()) + 2):
        caught = []
        drafter.draft_one_anchor(features, tokens, p, K, draw=lambda row, got=caught: got.append(row) or 0)
        mine[p] = torch.stack(caught)[:, ids]
    rows = [n for n, a in enumerate(anchor.tolist()) if a >= prompt_len - 1]
    expected = torch.stack([mine[int(anchor[n]) + 1][int(depth[n])] for n in rows])
    torch.testing.assert_close(logits[rows].float(), expected, rtol=1e-4, atol=1e-4)


def _trained_looking(build, vocab: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """(a peer's P-EAGLE module from ``build`` under seed 0, eval mode, with random weights, its own
    embedding (P-EAGLE trains it), every other target id as the draft vocabulary, a small ``mask_hidden``
    and attention strong enough that the context moves the mask slots' drafts; its d2t)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().eval()
        d2t = randomize_with_draft_vocab(model, torch.randn(vocab, model.config.hidden_size), vocab)
        with torch.no_grad():
            model.mask_hidden.normal_(0, 0.05)
            for name, param in model.named_parameters():
                if name.endswith(("v_proj.weight", "o_proj.weight")):
                    param.mul_(6)  # attention strong enough that the context moves the mask slots' drafts
    return model, d2t


def _mask_mod_sdpa(query, key, value, block_mask, **options):
    """A flex-attention call as sdpa: the peer's COD mask (its ``mask_mod`` on every query x key), the
    math flex attention does, without tracing its op (seconds on a CPU)."""
    rows = torch.arange(query.shape[-2])
    allowed = block_mask.mask_mod(0, 0, rows[:, None], rows[None, :])
    kept = {k: v for k, v in options.items() if k in ("scale", "enable_gqa")}
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, **kept)


def test_speculators_peagle_drafts_like_its_forward(peers, scorer_cache, tmp_path, monkeypatch):  # noqa: F811
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import core
    from speculators.models.peagle.config import PEagleSpeculatorConfig
    from transformers import Qwen3Config

    cache = hscache.open_cache(scorer_cache)
    vocab = cache.vocab_size
    layer = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    layer._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=vocab,
        eagle_aux_hidden_state_layer_ids=[2, 4, 8],  # vLLM aux ids: this project's layers 1, 3, 7
        mask_token_id=MASK,
        speculators_config=greedy_speculators_config(peers, "peagle", K),
    )
    torch.manual_seed(0)
    model = core.PEagleDraftModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "embed_tokens.weight":
                param.copy_(cache.target_head()["embed_tokens"])
            elif name == "mask_hidden":
                param.normal_(0, 0.05)  # small: the context then shows in the mask slots' drafts
            elif param.ndim == 2:
                param.normal_(0, 0.05)
            else:
                param.uniform_(0.8, 1.2)
    model.save_pretrained(str(tmp_path / "peagle"))

    drafter, _ = load_drafter(tmp_path / "peagle", cache, EvalConfig(ddtree=()))
    assert drafter.family == "peagle" and drafter.pard_token == MASK
    assert drafter.config.target_layer_ids == (1, 3, 7) and drafter.config.num_speculative_tokens == K
    features, tokens, prompt_len, ours = _our_drafts(drafter, cache)
    rows = len(tokens) - 2
    anchor, depth = _every_anchor_and_depth(rows)
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **_: (anchor, depth))
    caught = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out[0]))
    with torch.no_grad():
        model(
            hidden_states=features[None, :rows],
            input_ids=tokens[None, 1 : rows + 1],  # step 0 pairs F[i] with x[i+1]
            document_ids=torch.zeros(1, rows, dtype=torch.long),
            position_ids=torch.arange(rows)[None],
            verifier_last_hidden_states=torch.zeros(1, rows, layer.hidden_size),
            num_depths=K,
            loss_config=resolve_loss_config("kl_div", "eager"),  # its fused losses need Triton
        )
    _assert_same_as_peer(drafter, features, tokens, prompt_len, ours, anchor, depth, caught[0])


def test_specforge_peagle_export_drafts_like_its_cod_forward(peers, fp32_cache, tmp_path, monkeypatch):  # noqa: F811
    """SpecForge 0.2's ``PEagleDraftModel`` (modeling/draft/peagle.py), saved as its HF export saves it
    (``save_pretrained``: a flat LlamaConfig with ``norm_before_residual``, keys ``layers.N.*``, ``fc``,
    ``mask_hidden``, ``t2d``/``d2t``, its own trained ``embed_tokens``; the layers only in eagle_config,
    which vLLM reads one lower). It records no mask token (SpecForge resolves one at training time), so
    the scorer refuses it by name until one is given where vLLM reads it; then every anchor's K drafts
    equal ``OnlinePEagleModel.forward`` (algorithms/peagle/model.py) run over every anchor x depth, its
    logits caught where its loss would take them (the loss is a Triton kernel), its flex-attention mask run
    through sdpa."""
    import types

    # Its loss module imports Triton at import time; only LogSoftmaxLoss is named, and never runs here.
    monkeypatch.setitem(sys.modules, "specforge.core.loss", types.SimpleNamespace(LogSoftmaxLoss=None))
    from specforge.algorithms.peagle import model as cod
    from specforge.modeling.draft import peagle as draft
    from transformers import LlamaConfig

    from scorer.errors import CheckpointError

    cache = hscache.open_cache(fp32_cache)
    vocab = cache.vocab_size
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    )  # fmt: skip
    config.draft_vocab_size = vocab // 2
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}  # SGLang ids: layers 1, 3, 7
    model, d2t = _trained_looking(lambda: draft.PEagleDraftModel(config, norm_before_residual=True), vocab)
    out = tmp_path / "specforge"
    model.save_pretrained(str(out))
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["PEagleDraftModel"] and written["norm_before_residual"] is True

    with pytest.raises(CheckpointError, match="no mask_token_id"):
        load_drafter(out, cache, EvalConfig(ddtree=(), num_speculative_tokens=K))
    # vLLM reads dflash_config's first (llm_base_proposer.py:362-365), where SpecForge reads it too
    (out / "config.json").write_text(json.dumps({**written, "dflash_config": {"mask_token_id": MASK}}))
    drafter, loaded = load_drafter(out, cache, EvalConfig(ddtree=(), num_speculative_tokens=K))
    assert drafter.family == "peagle" and drafter.pard_token == MASK and drafter.config.norm_before_residual
    assert drafter.config.vllm_layer_ids == (0, 2, 6) and drafter.config.num_hidden_layers == 2
    features, tokens, prompt_len, ours = _our_drafts(drafter, cache)
    rows = len(tokens) - 2
    anchor, depth = _every_anchor_and_depth(rows)
    monkeypatch.setattr(cod, "generate_cod_sample_indices", lambda **_: (anchor, depth))
    caught = []
    monkeypatch.setattr(cod, "compute_peagle_metrics", lambda logits, **_: caught.append(logits) or (0, {}))
    monkeypatch.setattr(
        draft,
        "compile_friendly_flex_attention",
        lambda query, key, value, block_mask, **options: _mask_mod_sdpa(
            query, key, value, block_mask, **options
        ),
    )
    with torch.no_grad():
        cod.OnlinePEagleModel(model, mask_token_id=MASK, num_depths=K)(
            input_ids=tokens[None, 1 : rows + 1],  # SpecForge's capture shifts the ids: F[i] with x[i+1]
            attention_mask=torch.ones(1, rows, dtype=torch.long),
            target=None,
            loss_mask=torch.ones(1, rows, dtype=torch.long),
            hidden_states=features[None, :rows],
        )
    _assert_same_as_peer(drafter, features, tokens, prompt_len, ours, anchor, depth, caught[0][0], d2t)


def test_nemo_peagle_checkpoint_drafts_like_its_trainer(fp32_cache, tmp_path, monkeypatch):
    """NeMo Automodel 0.7's P-EAGLE: its EAGLE-3 draft class ``LlamaEagle3DraftModel`` with
    ``parallel_drafting`` (components/speculative/eagle/draft_llama.py), configured as its recipe writes it
    (recipes/llm/train_eagle3.py:609-646 and peagle_recipe.py: the target's config plus draft_vocab_size,
    target_hidden_size, fc_norm / norm_output false, mask_token_id, num_depths, 2 draft layers; no layer ids,
    so NeMo and vLLM both take the target's default [1, L/2-1, L-4]) and saved as its consolidated export
    saves it (model.safetensors with keys under ``model.``, config.json). Every anchor's K drafts equal its
    ``PEagleTrainerModule.forward`` (peagle_trainer.py) over every anchor x depth (COD sampling replaced), its
    logits caught at ``lm_head``, its flex-attention mask run through sdpa."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    eagle = "nemo_automodel.components.speculative.eagle"
    draft, trainer, cod, attention = (
        nemo_module(f"{eagle}.{name}", bare=eagle)
        for name in ("draft_llama", "peagle_trainer", "peagle_data", "peagle_draft")
    )
    cache = hscache.open_cache(fp32_cache)
    vocab = cache.vocab_size
    base = Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    ).to_dict()  # fmt: skip
    base.update(
        draft_vocab_size=vocab // 2, target_hidden_size=128, architectures=["LlamaEagle3DraftModel"],
        tie_word_embeddings=False, attn_implementation="eager", fc_norm=False, norm_output=False,
        parallel_drafting=True, mask_token_id=MASK, num_depths=K, down_sample_ratio=0.7,
        down_sample_ratio_min=0.2, num_hidden_layers=2, layer_types=base["layer_types"][:2],
    )  # fmt: skip
    model, d2t = _trained_looking(
        lambda: draft.LlamaEagle3DraftModel(Qwen3Config.from_dict(base)).float(), vocab
    )
    out = tmp_path / "nemo"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    model.config.to_json_file(str(out / "config.json"))

    drafter, loaded = load_drafter(out, cache, EvalConfig(ddtree=(), num_speculative_tokens=K))
    assert drafter.family == "peagle" and drafter.pard_token == MASK and not drafter.config.qk_norm
    assert drafter.config.target_layer_ids == (1, 3, 4) and drafter.config.num_hidden_layers == 2
    features, tokens, prompt_len, ours = _our_drafts(drafter, cache)
    rows = len(tokens) - 2
    anchor, depth = _every_anchor_and_depth(rows)
    monkeypatch.setattr(cod, "generate_cod_sample_indices", lambda **_: (anchor, depth))
    monkeypatch.setattr(attention, "_peagle_flex_attention", _mask_mod_sdpa)
    caught = []
    model.lm_head.register_forward_hook(lambda _m, _i, logits: caught.append(logits[0]))
    ids = torch.arange(vocab // 2) + d2t
    with torch.no_grad():
        trainer.PEagleTrainerModule(
            model, selected_token_ids=ids, selected_token_mask=None, num_depths=K, mask_token_id=MASK
        )(
            input_ids=tokens[None, 1 : rows + 1],  # NeMo's target batch shifts the ids: F[i] with x[i+1]
            attention_mask=torch.ones(1, rows, dtype=torch.long),
            loss_mask=torch.ones(1, rows, dtype=torch.long),
            aux_hidden_states=features[None, :rows],
            target_logits=torch.zeros(1, rows, vocab),
        )
    _assert_same_as_peer(drafter, features, tokens, prompt_len, ours, anchor, depth, caught[0], d2t)
