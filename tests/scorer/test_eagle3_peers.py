"""EAGLE-3 drafts equal the peers' own forwards on the same inputs (their classes, their savers).

The peers run from a test-only directory ``.peers/`` (``pip install --no-deps --target .peers
speculators==0.9.0 specforge==0.2.0``; .ci/run does it); without it these tests skip with that
line. speculators' package imports its training data pipeline at import time (openai, datasets,
hs_connectors); those modules are stubbed here, since nothing of them runs in a forward. CPU time:
importing the peers costs a few seconds (torch inductor, transformers integrations), once.

Both peers' forwards are their TRAINING forwards: step j > 0 is fed the ground-truth token
(speculators ``Eagle3DraftModel.forward``; SpecForge ``OnlineEagle3Model.forward``'s TTT loop,
transcribed below with its sdpa backend and ``cache_hidden``), so they are compared with the
scorer's teacher-forced drafts; step 0 is what serving drafts too.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import hscache
from scorer.families.eagle3.drafting import draft_every_anchor
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, load_drafter

PEERS = Path(__file__).resolve().parents[2] / ".peers"
_STUBBED = (
    "openai",
    "openai.types",
    "openai.types.chat",
    "openai.types.completion",
    "datasets",
    "hs_connectors",
)
K = 3


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


@pytest.fixture(scope="module")
def peers():
    if not (PEERS / "speculators").is_dir() or not (PEERS / "specforge").is_dir():
        pytest.skip(
            "peer oracles not installed: pip install --no-deps --target .peers speculators==0.9.0 specforge==0.2.0"
        )
    import torch._dynamo

    saved_path, saved_modules = list(sys.path), dict(sys.modules)
    saved_dynamo = torch._dynamo.config.disable
    # SpecForge decorates its RMSNorm with torch.compile: eager runs the same math without ~10 s
    # of inductor compilation on a CPU.
    torch._dynamo.config.disable = True
    sys.path.insert(0, str(PEERS))
    for name in _STUBBED:
        sys.modules.setdefault(name, _Stub(name))
    try:
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.utils import padding
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.models.eagle3.core import Eagle3DraftModel
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        yield types.SimpleNamespace(
            LlamaForCausalLMEagle3=LlamaForCausalLMEagle3,
            SpeculatorsConfig=SpeculatorsConfig,
            VerifierConfig=VerifierConfig,
            Eagle3SpeculatorConfig=Eagle3SpeculatorConfig,
            Eagle3DraftModel=Eagle3DraftModel,
            GreedyTokenProposalConfig=GreedyTokenProposalConfig,
            padding=padding,
        )
    finally:
        torch._dynamo.config.disable = saved_dynamo
        sys.path[:] = saved_path
        # Forget the peers' own modules and the stubs, nothing else: a library module their import
        # pulled in (torch inductor's caches register themselves once per process) cannot be imported
        # a second time, as NeMo's import in test_dflash2.py then would. NeMo's modules (imported by
        # tests/scorer/nemo_peer.py while this fixture is up) stay, imported once per process as there.
        for name in set(sys.modules) - set(saved_modules):
            module = sys.modules.get(name)  # NeMo's imports drop some modules of their own as they go
            if module is not None and name.split(".")[0] != "nemo_automodel":
                if name in _STUBBED or _from_peers(module):
                    del sys.modules[name]


def greedy_speculators_config(peers, algorithm: str, tokens: int):
    """speculators' own ``SpeculatorsConfig`` for a drafter of ``algorithm`` proposing ``tokens`` greedily
    (no verifier checkpoint): what each peer test builds its speculators model with."""
    return peers.SpeculatorsConfig(
        algorithm=algorithm,
        proposal_methods=[peers.GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy",
        verifier=peers.VerifierConfig(name_or_path=None, architectures=[]),
    )


def _from_peers(module: types.ModuleType) -> bool:
    """The module (or package) lives under ``.peers/``."""
    places = [getattr(module, "__file__", None), *(getattr(module, "__path__", None) or [])]
    return any(place and Path(place).resolve().is_relative_to(PEERS.resolve()) for place in places)


def randomize_with_draft_vocab(model: torch.nn.Module, embed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Random weights (norms near 1), the target's embedding, every other target id as the draft
    vocabulary; returns d2t."""
    draft_vocab = model.lm_head.weight.shape[0]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):  # NeMo's sits under ``model.``
                param.copy_(embed)
            elif param.ndim == 2:
                param.normal_(0, 0.05)
            else:
                param.uniform_(0.8, 1.2)
        ids = torch.arange(draft_vocab) * (vocab // draft_vocab)
        model.d2t.copy_(ids - torch.arange(draft_vocab))
        model.t2d.zero_()
        model.t2d[ids] = True
    return model.d2t.clone()


def _inputs(cache, drafter, row: int = 1):
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", None)
    return features, cache.token_ids(row).long(), cache.index.column("prompt_len")[row].as_py()


def _assert_equal_in_range(ours: np.ndarray, theirs: np.ndarray, prompt_len: int, seq_len: int) -> None:
    """Rows are step-0 rows P-1..T-3; column j drafts position row + 2 + j, inside when <= T-1."""
    rows = np.arange(len(ours))[:, None] + prompt_len - 1
    valid = rows + 2 + np.arange(ours.shape[1])[None] <= seq_len - 1
    np.testing.assert_array_equal(ours[valid], theirs[valid])
    assert valid.sum() > 20


@pytest.mark.parametrize(
    "options, layer_type",
    [
        ({}, "qwen3"),
        ({"norm_before_residual": True, "fc_norm": True}, "qwen3"),
        ({"norm_before_fc": True, "norm_output": True}, "llama"),
    ],
)
def test_speculators_eagle3_saved_by_speculators_drafts_like_its_forward(
    peers, scorer_cache, tmp_path, options, layer_type
):
    from transformers import LlamaConfig, Qwen3Config

    cache = hscache.open_cache(scorer_cache)
    vocab = cache.vocab_size
    dims = dict(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    layer_config = (Qwen3Config if layer_type == "qwen3" else LlamaConfig)(**dims)
    layer_config._attn_implementation = "eager"
    config = peers.Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=vocab // 2,
        eagle_aux_hidden_state_layer_ids=[2, 4, 8],  # vLLM aux ids: this project's layers 1, 3, 7
        speculators_config=greedy_speculators_config(peers, "eagle3", K),
        **options,
    )
    torch.manual_seed(0)
    model = peers.Eagle3DraftModel(config).eval()
    d2t = randomize_with_draft_vocab(model, cache.target_head()["embed_tokens"], vocab)
    model.save_pretrained(str(tmp_path / "speculators"))

    drafter, loaded = load_drafter(tmp_path / "speculators", cache, EvalConfig())
    assert drafter.config.target_layer_ids == (1, 3, 7) and drafter.config.qk_norm == (layer_type == "qwen3")
    assert drafter.config.num_speculative_tokens == K
    features, tokens, prompt_len = _inputs(cache, drafter)
    seq_len = len(tokens)
    ours = draft_every_anchor(drafter, features, tokens, prompt_len, K, teacher_forced=True)
    with torch.no_grad():
        drafted = model(
            hidden_states=features[None, : seq_len - 2],
            input_ids=tokens[None, 1 : seq_len - 1],  # step 0 pairs F[i] with x[i+1]
            document_ids=torch.zeros(1, seq_len - 2, dtype=torch.long),
            position_ids=torch.arange(seq_len - 2)[None],
            ttt_steps=K,
        )
    theirs = np.stack([(d[0] + d2t[d[0]]).numpy() for d in drafted], axis=1)[prompt_len - 1 :]
    _assert_equal_in_range(ours, theirs, prompt_len, seq_len)


def test_specforge_llama_eagle3_saved_by_specforge_drafts_like_its_ttt_loop(peers, fp32_cache, tmp_path):
    """On a cache of every layer: SpecForge's save names the layers only in eagle_config, so vLLM would
    feed the drafter the layers one lower (vllm_layer_ids), which the scorer then needs too."""
    from transformers import LlamaConfig

    cache = hscache.open_cache(fp32_cache)
    vocab = cache.vocab_size
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    )  # fmt: skip
    config.draft_vocab_size = vocab // 2
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}  # SGLang ids: layers 1, 3, 7
    torch.manual_seed(0)
    model = peers.LlamaForCausalLMEagle3(config).eval()
    d2t = randomize_with_draft_vocab(model, cache.target_head()["embed_tokens"], vocab)
    model.save_pretrained(str(tmp_path / "specforge"))

    drafter, loaded = load_drafter(tmp_path / "specforge", cache, EvalConfig(num_speculative_tokens=K))
    assert loaded.report.layout == "specforge" and drafter.config.target_layer_ids == (1, 3, 7)
    assert drafter.config.vllm_layer_ids == (0, 2, 6)  # SpecForge writes no top-level ids
    features, tokens, prompt_len = _inputs(cache, drafter)
    seq_len = len(tokens)
    ours = draft_every_anchor(drafter, features, tokens, prompt_len, K, teacher_forced=True)
    # OnlineEagle3Model.forward (algorithms/eagle3/model.py), sdpa backend: project once, then per
    # TTT step embed the (shifted) input ids, backbone with cache_hidden, compute_logits, shift.
    n = seq_len - 2
    with torch.no_grad():
        hidden = model.project_hidden_states(features[None, :n])
        position_ids = torch.arange(n)[None]
        mask = model.prepare_decoder_attention_mask(
            attention_mask=torch.ones(1, n, dtype=torch.bool),
            hidden_states=hidden,
            batch_size=1,
            seq_length=n,
            past_key_values_length=0,
        )
        input_ids, cache_hidden, drafted = tokens[None, 1 : n + 1], [[], []], []
        for _ in range(K):
            embeds = model.embed_input_ids(input_ids).to(hidden.dtype)
            hidden = model.backbone(
                input_embeds=embeds,
                hidden_states=hidden,
                cache_hidden=cache_hidden,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=None,
                use_cache=True,
            )
            ids = model.compute_logits(hidden).argmax(-1)[0]
            drafted.append((ids + d2t[ids]).numpy())
            input_ids = peers.padding(input_ids, left=False)
    theirs = np.stack(drafted, axis=1)[prompt_len - 1 :]
    _assert_equal_in_range(ours, theirs, prompt_len, seq_len)
