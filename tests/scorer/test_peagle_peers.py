"""P-EAGLE written by speculators 0.9 (its ``PEagleDraftModel`` and saver) loads as the peagle family and drafts,
at every anchor and parallel slot, what speculators' own forward predicts there.

speculators' forward is its TRAINING forward: COD sampling draws which (anchor, depth) rows it runs; here it is
made to run all of them (``generate_cod_sample_indices`` replaced by every anchor x depth < K), and the drafts
are read off its ``lm_head``. Its rows are vLLM's: depth 0 at anchor a is step 0's row (target state a, token
a+1, position a), depth d the mask token and ``mask_hidden`` at position a+d, attending to the depth-0 rows up
to a and to its own rollout (``create_peagle_mask_mod``). The ``peers`` fixture (.peers, stubs) is
test_eagle3_peers.py's."""

from __future__ import annotations

import numpy as np
import torch
from test_eagle3_peers import K, greedy_speculators_config, peers  # noqa: F401  (the fixture, used by name)

import hscache
from scorer.families.eagle3.drafting import draft_every_anchor
from scorer.offline.scoring import EvalConfig, load_drafter
from scorer.offline.sequences import sequence_features

MASK = 7


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
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(1), index, torch.float32, "cpu", None)
    tokens, prompt_len = cache.token_ids(1).long(), int(cache.index.column("prompt_len")[1].as_py())
    rows = len(tokens) - 2
    ours = draft_every_anchor(drafter, features, tokens, prompt_len, K)

    anchor = torch.cat([torch.arange(rows - d) for d in range(K)])  # every anchor x depth, depth-major
    depth = torch.cat([torch.full((rows - d,), d) for d in range(K)])
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
    theirs = np.full_like(ours, -1)
    drafted = caught[0].argmax(-1).numpy()
    for (a, d), token in zip(zip(anchor.tolist(), depth.tolist()), drafted):
        if a >= prompt_len - 1:
            theirs[a - (prompt_len - 1), d] = token  # anchor p = a + 1, slot d + 1
    valid = theirs >= 0
    assert valid.sum() > 30 and len(np.unique(ours[:, 1:])) > 1  # the mask slots' drafts vary
    np.testing.assert_array_equal(ours[valid], theirs[valid])
