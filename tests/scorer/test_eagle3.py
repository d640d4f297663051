"""EAGLE-3 on the family seam: layouts, vLLM-served drafting, the teacher-forced number, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache import schemas
from scorer.cli import main
from scorer.families.eagle3.drafting import draft_every_anchor, draft_every_anchor_one_by_one
from scorer.families.eagle3.init import init_eagle3, save_eagle3
from scorer.families.eagle3.layouts import read_eagle3
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, evaluate, load_drafter
from tests.scorer.family_contract import FamilyContract


def _features(cache, drafter, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", None)
    return features, cache.token_ids(row), cache.index.column("prompt_len")[row].as_py()


@pytest.fixture(scope="module")
def reduced(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer EAGLE-3 with a reduced draft vocabulary (d2t) and per-feature fc norms."""
    out = tmp_path_factory.mktemp("e3") / "reduced"
    cache = hscache.open_cache(scorer_cache)
    init_eagle3(
        scorer_cache,
        out,
        layer_ids=[7, 1, 3],
        num_layers=2,
        draft_vocab_size=cache.vocab_size // 2,
        fc_norm=True,
    )
    return out


def test_batched_drafts_equal_vllm_loop_one_anchor_at_a_time(scorer_cache, reduced, eagle3_drafter):
    """Step 0 over the whole sequence + later steps of every anchor under the mask == vLLM's
    propose loop run per anchor (v1/spec_decode/eagle.py: shifted input ids, target positions,
    positions += 1, hidden_prenorm fed back; fp32, argmax exactly equal)."""
    cache = hscache.open_cache(scorer_cache)
    for checkpoint in (reduced, eagle3_drafter):
        drafter, _ = load_drafter(checkpoint, cache, EvalConfig())
        features, tokens, prompt_len = _features(cache, drafter, 1)
        batched = draft_every_anchor(drafter, features, tokens, prompt_len, 4, max_rows=5)
        reference = draft_every_anchor_one_by_one(drafter, features, tokens, prompt_len, 4)
        assert batched.shape == (len(tokens) - 1 - prompt_len, 4)
        np.testing.assert_array_equal(batched, reference)
        # A memory budget that allows one row per chunk changes nothing.
        tight = draft_every_anchor(drafter, features, tokens, prompt_len, 4, memory_gb=1e-5)
        np.testing.assert_array_equal(tight, reference)


def test_reduced_vocabulary_maps_draft_ids_like_vllm_compute_logits(scorer_cache, reduced):
    """vLLM llama_eagle3.py compute_logits: logits_new = -inf over the target vocabulary,
    logits_new[:, arange(Vd) + d2t] = logits; the draft is its argmax."""
    cache = hscache.open_cache(scorer_cache)
    drafter, _ = load_drafter(reduced, cache, EvalConfig())
    _, _, head, _ = read_eagle3(reduced, num_target_layers=8)
    features, tokens, prompt_len = _features(cache, drafter, 0)
    normed, _, _ = drafter.step0(features, tokens, len(tokens) - 2)
    with torch.no_grad():
        logits = drafter.head_logits(normed)
    full = torch.full((logits.shape[0], cache.vocab_size), float("-inf"))
    full[:, torch.arange(logits.shape[1]) + head["d2t"]] = logits
    drafts = draft_every_anchor(drafter, features, tokens, prompt_len, 1)
    np.testing.assert_array_equal(drafts[:, 0], full.argmax(-1)[prompt_len - 1 :].numpy())
    allowed = set((torch.arange(len(head["d2t"])) + head["d2t"]).tolist())
    assert set(drafts.ravel().tolist()) <= allowed and len(allowed) < cache.vocab_size


def test_three_layouts_read_their_own_layer_conventions_and_score_the_same(scorer_cache, tmp_path):
    """speculators (vLLM aux ids, +1), SpecForge (SGLang ids under eagle_config), the original
    release (pytorch_model.bin, default layers): one set of weights, the same drafts."""
    config, drafter = init_eagle3(scorer_cache, tmp_path / "speculators", layer_ids=[1, 3, 7], qk_norm=False)
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    save_eagle3(tmp_path / "specforge", config, drafter.state_dict(), layout="specforge")
    sf = json.loads((tmp_path / "specforge" / "config.json").read_text())
    assert sf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]
    reports = {
        name: evaluate(tmp_path / name, scorer_cache, EvalConfig(n_boot=10, limit=2))
        for name in ("speculators", "specforge")
    }
    assert reports["specforge"]["checkpoint"]["layout"] == "specforge"
    assert "midlayer. -> layers.0." in reports["specforge"]["checkpoint"]["stripped_prefixes"]
    for name in reports:
        assert reports[name]["drafter"]["target_layer_ids"] == [1, 3, 7]
    # The export names the layers for vLLM too (top level, vLLM aux ids): both engines feed the same
    # layers, so no note (test_a_specforge_export_is_replayed_on_the_layers_each_engine_feeds_it).
    assert sf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    for name in reports:
        assert not any("vllm 0.32.0 serves" in n for n in reports[name]["checkpoint"]["notes"])
    assert [r["accepted"] for r in reports["speculators"]["per_request"]] == [
        r["accepted"] for r in reports["specforge"]["per_request"]
    ]
    # The original release names no layers: the default [1, L//2-1, L-4] = [1, 3, 4] is not in the
    # cache (1,3,7), which is one line naming the --layers to re-extract with.
    release = tmp_path / "release"
    save_eagle3(release, config, drafter.state_dict(), layout="eagle_release")
    assert (release / "pytorch_model.bin").is_file()
    result = CliRunner().invoke(main, ["eval", str(release), "--cache", str(scorer_cache)])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "need layers [4]" in line and "--layers 1,3,4,7" in line
    loaded = read_eagle3(release, num_target_layers=8)
    assert loaded[3].layout == "eagle_release" and loaded[0].target_layer_ids == (1, 3, 4)


def test_report_serves_k_and_puts_teacher_forced_beside(scorer_cache, eagle3_drafter):
    report = evaluate(eagle3_drafter, scorer_cache, EvalConfig(n_boot=20))
    schemas.validate(report, "eval_report")
    assert report["drafter"]["family"] == "eagle3" and report["drafter"]["num_speculative_tokens"] == 3
    assert report["checkpoint"]["field_sources"]["num_speculative_tokens"] == "config"
    assert any(n.startswith("embedding: the target's") for n in report["checkpoint"]["notes"])
    assert len(report["acceptance"]["unconditional"]) == 3 and report["ddtree"] == {}
    served = report["acceptance"]["unconditional"]
    forced = report["teacher_forced"]["acceptance"]["unconditional"]
    # Slot 1 is drafted from target features only: identical. Later slots differ (training feeds
    # the ground truth after a miss); leading-correct counts cannot (a correct prefix IS the truth).
    assert served[0] == forced[0] and served != forced
    assert report["teacher_forced"]["accept_len"] == pytest.approx(report["train_accept_len"])
    assert 1.0 < report["tau"]["pooled"] < 4.0
    longer = evaluate(eagle3_drafter, scorer_cache, EvalConfig(n_boot=20, num_speculative_tokens=5))
    assert len(longer["acceptance"]["unconditional"]) == 5
    assert longer["config"]["num_speculative_tokens"] == 5
    assert longer["checkpoint"]["field_sources"]["num_speculative_tokens"] == "override"


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda c: c["transformer_layer_config"].update(partial_rotary_factor=0.5),
            "partial_rotary_factor=0.5",
        ),
        (
            lambda c: c["transformer_layer_config"].update(
                layer_types=["sliding_attention"], sliding_window=4
            ),
            "sliding",
        ),
        (lambda c: c.update(norm_before_fc=True, fc_norm=True), "mutually exclusive"),
        (lambda c: c["transformer_layer_config"].update(model_type="gemma3"), "'gemma3' is not supported"),
    ],
)
def test_unsupported_options_are_refused_by_name(scorer_cache, eagle3_drafter, tmp_path, edit, expected):
    bad = tmp_path / "bad"
    shutil.copytree(eagle3_drafter, bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["eval", str(bad), "--cache", str(scorer_cache)])
    assert result.exit_code == 2, result.output
    assert expected in result.output and len(result.output.strip().splitlines()) == 1


def test_unknown_key_and_cache_mismatches_are_one_line_each_named(scorer_cache, eagle3_drafter, tmp_path):
    from safetensors.torch import load_file, save_file

    extra = tmp_path / "extra"
    shutil.copytree(eagle3_drafter, extra)
    weights = load_file(extra / "model.safetensors")
    weights["layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(weights, extra / "model.safetensors")
    result = CliRunner().invoke(main, ["eval", str(extra), "--cache", str(scorer_cache)])
    assert result.exit_code == 2 and "unexpected 1 key: layers.0.self_attn.sinks" in result.output

    mismatch = tmp_path / "mismatch"
    shutil.copytree(eagle3_drafter, mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    config["target_hidden_size"] = 64
    config["transformer_layer_config"]["vocab_size"] += 1
    (mismatch / "config.json").write_text(json.dumps(config))
    fc = load_file(mismatch / "model.safetensors")
    fc["fc.weight"] = torch.zeros(fc["fc.weight"].shape[0], 3 * 64)
    # V draft ids of a V + 1-id vocabulary: a reduced vocabulary, so its map (a full one ships none)
    fc["d2t"] = torch.zeros(config["draft_vocab_size"], dtype=torch.long)
    fc["t2d"] = torch.cat(
        [torch.ones(config["draft_vocab_size"], dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]
    )
    save_file(fc, mismatch / "model.safetensors")
    result = CliRunner().invoke(main, ["eval", str(mismatch), "--cache", str(scorer_cache)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "target_hidden_size 64 != target hidden size 128" in line
    assert "vocab_size" in line and "Traceback" not in line


def test_flags_that_do_not_fit_the_family_are_refused(scorer_cache, eagle3_drafter, trained_drafter):
    runner = CliRunner()
    result = runner.invoke(
        main, ["eval", str(eagle3_drafter), "--cache", str(scorer_cache), "--block-size", "4"]
    )
    assert result.exit_code == 2 and "--block-size" in result.output
    result = runner.invoke(
        main, ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--tree", "3,2,4"]
    )
    assert result.exit_code == 2 and "DFlash drafter drafts a block" in result.output
    # --num-speculative-tokens is vLLM's K for DFlash (a block of K + 1): refused only against --block-size
    args = ["--num-speculative-tokens", "2", "--block-size", "5"]
    result = runner.invoke(main, ["eval", str(trained_drafter), "--cache", str(scorer_cache), *args])
    assert (
        result.exit_code == 2
        and "--num-speculative-tokens 2" in result.output
        and "disagree" in result.output
    )
    result = runner.invoke(main, ["eval", "target:mtp", "--cache", str(scorer_cache), "--ddtree", "4"])
    assert result.exit_code == 2 and "--ddtree does not apply to target:mtp" in result.output
    result = runner.invoke(main, ["eval", "target:mtp", "--cache", str(scorer_cache)])
    assert result.exit_code == 0, result.output  # the MTP family exists (tests/scorer/test_mtp.py)
    result = runner.invoke(main, ["eval", "target:medusa", "--cache", str(scorer_cache)])
    assert result.exit_code == 2 and "unknown target head 'medusa'" in result.output
    result = runner.invoke(
        main, ["eval", str(eagle3_drafter), "--cache", str(scorer_cache), "--anchors", "chain"]
    )
    assert result.exit_code == 2 and "--anchors chain" in result.output


def test_unknown_layout_is_one_line_naming_it(scorer_cache, eagle3_drafter, tmp_path):
    other = tmp_path / "xpress"  # speculators 0.9 trains it; no engine here serves it
    shutil.copytree(eagle3_drafter, other)
    config = json.loads((other / "config.json").read_text())
    config["speculators_model_type"] = "xpress"
    (other / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["eval", str(other), "--cache", str(scorer_cache)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert (
        "speculators_model_type 'xpress'" in result.output
        and "known: dflash, dspark, eagle3, peagle" in result.output
    )


class TestEagle3Contract(FamilyContract):
    """The family contract for EAGLE-3 (speculators layout, K 3); its online == offline case
    replaces the hand-written hybrid-target one (vLLM's propose loop per round == scorer eval)."""

    family = "eagle3"

    @pytest.fixture
    def checkpoint(self, eagle3_drafter):
        return str(eagle3_drafter)


@pytest.mark.slow
def test_online_rounds_equal_offline_replay_qwen3_target(qwen3_cache, tmp_path):
    from scorer.families.eagle3.train import train_eagle3
    from scorer.online.greedy import OnlineConfig, run_online

    cache = qwen3_cache  # tiny-qwen3, 2 prompts x 16 tokens, layers 1,3,4,7
    drafter = tmp_path / "eagle3"
    train_eagle3(cache, drafter, steps=25, num_speculative_tokens=4)  # the engines' default layers 1,3,4
    offline = evaluate(drafter, cache, EvalConfig(n_boot=10))
    online = run_online(drafter, OnlineConfig(model="builtin:tiny-qwen3", max_new_tokens=16, limit=2))
    _assert_same_rounds(offline, online)


def _assert_same_rounds(offline: dict, online: dict) -> None:
    assert offline["off_greedy"]["positions"] == 0  # fp32: the cache is the target's greedy path
    for off, on in zip(offline["per_request"], online["per_request"], strict=True):
        assert on["record_id"] == off["record_id"]
        tokens = [
            min(a + 1, on["generated"] + off["anchors"][0] - 1 - p)
            for a, p in zip(off["accepted"], off["anchors"])
        ]
        assert on["tokens_per_round"] == tokens, off["record_id"]
    assert online["tau"]["pooled"] == offline["tau"]["pooled"]
    assert offline["tau"]["pooled"] > 1.0


def _sglang_tree_depth(
    drafter, features, tokens, greedy, p: int, steps: int, topk: int, n_tokens: int
) -> int:
    """SGLang's draft_forward for one request (batch 1), transcribed: select_top_k_tokens,
    organize_draft_results, and a KV cache per topk slot (generate_draft_decode_kv_indices: the
    prefix plus that slot's own entries), then greedy verification from the root."""
    import math

    c = drafter.config
    rep, scale = c.num_attention_heads // c.num_key_value_heads, 1.0 / math.sqrt(c.head_dim)
    with torch.no_grad():
        normed0, fed0, prefix = drafter.step0(features, tokens, p)  # the draft extend over rows 0..p-1
        topk_p, topk_index = torch.topk(torch.softmax(drafter.head_logits(normed0[-1:]).float(), -1), topk)
        hidden = fed0[-1:]
        score_list, token_list, parents_list = [], [], []
        slot_kv = [[[] for _ in drafter.layers] for _ in range(topk)]
        scores = None
        for i in range(steps):
            if i == 0:
                input_ids = topk_index.flatten()
                hidden = hidden.repeat_interleave(topk, dim=0)
                scores = topk_p
                score_list.append(topk_p.unsqueeze(1))
                token_list.append(topk_index)
                parents_list.append(torch.arange(-1, topk).unsqueeze(0))
            else:
                expand = scores.unsqueeze(2) * topk_p.reshape(-1, topk, topk)
                cs_p, cs_index = torch.topk(expand.flatten(start_dim=1), topk, dim=-1)
                scores = cs_p
                flat_index = topk_index.reshape(-1, topk**2)
                input_ids = torch.gather(flat_index, index=cs_index, dim=1).flatten()
                hidden = hidden[cs_index.flatten() // topk]
                score_list.append(expand)
                token_list.append(flat_index)
                parents_list.append(cs_index + (topk**2 * (i - 1) + topk))
            if i == steps - 1:
                break
            outs, nexts = [], []
            for t in range(topk):  # one decode row per slot: position p - 1 + (i + 1)
                emb = drafter._embed(drafter.to_target(input_ids[t : t + 1]))
                cos, sin = drafter._cos_sin(torch.tensor([p + i]), hidden.dtype)
                h = hidden[t : t + 1]
                for n, layer in enumerate(drafter.layers):
                    x, residual = layer.enter(emb, h)
                    q, k, v = layer.self_attn.qkv(x, cos, sin)
                    slot_kv[t][n].append((k, v))
                    keys = torch.cat([prefix[n][0]] + [kk for kk, _ in slot_kv[t][n]])
                    values = torch.cat([prefix[n][1]] + [vv for _, vv in slot_kv[t][n]])
                    s = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(rep, 1)) * scale
                    probs = torch.softmax(s, -1, dtype=torch.float32)
                    h = layer.leave(
                        residual, torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(rep, 1))
                    )
                normed, fed = drafter.finish(h)
                outs.append(torch.softmax(drafter.head_logits(normed).float(), -1))
                nexts.append(fed)
            topk_p, topk_index = torch.topk(torch.cat(outs), topk, dim=-1)
            hidden = torch.cat(nexts)
        all_scores = torch.cat(score_list, dim=1).flatten(1)
        all_tokens = drafter.to_target(torch.cat(token_list, dim=1))[0]
        keep = torch.sort(torch.topk(all_scores, n_tokens - 1, dim=-1).indices).values[0].tolist()
        parent_of = torch.cat(parents_list[:-1], dim=1)[0] if len(parents_list) > 1 else torch.tensor([-1])
    # the parent of candidate j is parent_of[j // topk] (build_tree_kernel_efficient)
    node, depth = -1, 0
    while p + depth < len(tokens) - 1:
        children = [
            j for j in keep if int(parent_of[j // topk]) == node and int(all_tokens[j]) == greedy[p + depth]
        ]
        if not children:
            break
        node, depth = children[0], depth + 1
    return depth


@pytest.mark.parametrize("tree", [(3, 2, 5), (4, 3, 8)])
def test_tree_depths_equal_sglang_draft_forward_per_anchor(scorer_cache, eagle3_drafter, reduced, tree):
    from scorer.families.autoregressive import tree_depths

    cache = hscache.open_cache(scorer_cache)
    for checkpoint in (eagle3_drafter, reduced):
        drafter, _ = load_drafter(checkpoint, cache, EvalConfig())
        features, tokens, prompt_len = _features(cache, drafter, 2)
        greedy = cache.target_argmax(2).numpy()
        batched = tree_depths(drafter, features, tokens, cache.target_argmax(2), prompt_len, tree, max_rows=4)
        steps, topk, n = tree
        reference = [
            _sglang_tree_depth(drafter, features, tokens, greedy, p, steps, topk, n)
            for p in range(prompt_len, len(tokens) - 1)
        ]
        assert batched.tolist() == reference


def test_tree_with_topk_1_is_the_chain_and_wider_trees_accept_more(scorer_cache, eagle3_drafter):
    chain = evaluate(eagle3_drafter, scorer_cache, EvalConfig(n_boot=10, num_speculative_tokens=4))
    one = evaluate(
        eagle3_drafter, scorer_cache, EvalConfig(n_boot=10, num_speculative_tokens=4, tree=(4, 1, 9))
    )
    assert one["config"]["tree"] == [4, 1, 5]  # SGLang: topk 1 sets draft tokens to steps + 1
    assert one["tree"]["tau"] == chain["tau"]
    wide = evaluate(eagle3_drafter, scorer_cache, EvalConfig(n_boot=10, tree=(5, 4, 8)))
    schemas.validate(wide, "eval_report")
    assert wide["tree"]["tau"]["pooled"] >= wide["tau"]["pooled"]
    result = CliRunner().invoke(
        main, ["eval", str(eagle3_drafter), "--cache", str(scorer_cache), "--tree", "2,2,9"]
    )
    assert result.exit_code == 2 and "TOKENS must be 2..7" in result.output
    args = ["eval", str(eagle3_drafter), "--cache", str(scorer_cache), "--tree", "3,2,5", "--limit", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    for line in ("EAGLE-3 replay", "SGLang tree 3,2,5 tau", "teacher-forced steps > 0"):
        assert line in result.output


def test_cli_online_takes_the_chain_length(eagle3_drafter, tmp_path):
    out = tmp_path / "online.json"
    args = [
        "online",
        str(eagle3_drafter),
        "--max-new-tokens",
        "6",
        "--limit",
        "1",
        "--num-speculative-tokens",
        "2",
    ]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    schemas.validate(document, "online_report")
    assert document["family"] == "eagle3" and max(document["per_request"][0]["tokens_per_round"]) <= 3
    assert document["checkpoint"]["field_sources"]["num_speculative_tokens"] == "override"
    result = CliRunner().invoke(main, [*args, "--block-size", "4"])
    assert result.exit_code == 2 and "--block-size" in result.output


def test_cli_init_writes_each_layout_the_loader_reads(diagnose_cache, tmp_path):
    # diagnose_cache holds every layer, the engines' default [1, 3, 4] included (init refuses a cache
    # that lacks one, as training does)
    for layout, weights in (("specforge", "model.safetensors"), ("eagle_release", "pytorch_model.bin")):
        out = tmp_path / layout
        args = ["init", str(out), "--cache", str(diagnose_cache), "--family", "eagle3", "--layout", layout]
        result = CliRunner().invoke(main, [*args, "--num-speculative-tokens", "2"])
        assert result.exit_code == 0, result.output
        assert (out / weights).is_file() and "target layers [1, 3, 4]" in result.output
        config, weights_read, _, report = read_eagle3(out, num_target_layers=8, num_speculative_tokens=2)
        assert (
            report.layout == layout and not config.qk_norm and "layers.0.hidden_norm.weight" in weights_read
        )


def test_specforge_training_state_reads_with_its_draft_config(scorer_cache, tmp_path):
    """SpecForge's {run}-stepN/training_state.pt: draft_state_dict (midlayer.* keys), no config.json."""
    config, drafter = init_eagle3(
        scorer_cache, tmp_path / "export", layer_ids=[1, 3, 7], qk_norm=False, layout="specforge"
    )
    step = tmp_path / "run-step120"
    step.mkdir()
    weights = {
        ("midlayer." + k[9:] if k.startswith("layers.0.") else k): v for k, v in drafter.state_dict().items()
    }
    torch.save(
        {"draft_state_dict": weights, "step": 120, "optimizer": {"lr": 1e-4}}, step / "training_state.pt"
    )
    draft_config = tmp_path / "draft.json"
    shutil.copy(tmp_path / "export" / "config.json", draft_config)
    args = [
        "eval",
        str(step),
        "--cache",
        str(scorer_cache),
        "--limit",
        "2",
        "--json",
        str(tmp_path / "r.json"),
    ]
    result = CliRunner().invoke(main, [*args, "--config", str(draft_config)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    export = evaluate(tmp_path / "export", scorer_cache, EvalConfig(limit=2, n_boot=10))
    assert report["checkpoint"]["format"] == "specforge_training_state"
    assert report["checkpoint"]["weights_sha256"] == export["checkpoint"]["weights_sha256"]
    assert [r["accepted"] for r in report["per_request"]] == [r["accepted"] for r in export["per_request"]]
    result = CliRunner().invoke(main, args)
    assert (
        result.exit_code == 2 and "--config" in result.output and len(result.output.strip().splitlines()) == 1
    )


def test_an_explicit_ddtree_is_refused_by_name_for_eagle3_and_its_default_is_not(
    eagle3_drafter, scorer_cache
):
    runner = CliRunner()
    args = ["eval", str(eagle3_drafter), "--cache", str(scorer_cache), "--limit", "1"]
    refused = runner.invoke(main, [*args, "--ddtree", "8"])
    lines = refused.output.strip().splitlines()
    assert (
        refused.exit_code == 2
        and len(lines) == 1
        and lines[0].startswith("error: --ddtree does not apply to")
    )
    assert runner.invoke(main, args).exit_code == 0  # the default budgets: dropped for EAGLE-3, as reported
    assert runner.invoke(main, [*args, "--ddtree", ""]).exit_code == 0  # explicitly none: fine


def test_dflash_num_speculative_tokens_is_vllms_k_a_block_of_k_plus_one(scorer_cache, trained_drafter):
    """vLLM drafts a DFlash block of 1 + num_speculative_tokens slots whatever block the drafter was
    trained at (vllm 0.32.0 v1/spec_decode/dflash.py:126): `--num-speculative-tokens K` scores that block."""
    from scorer.offline.scoring import EvalConfig
    from scorer.studies.evaluate import evaluate

    as_k = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20, num_speculative_tokens=2))
    as_block = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20, block_size=3))
    trained = evaluate(trained_drafter, scorer_cache, EvalConfig(ddtree=(), n_boot=20))
    assert [r["accepted"] for r in as_k["per_request"]] == [r["accepted"] for r in as_block["per_request"]]
    assert max(a for r in as_k["per_request"] for a in r["accepted"]) <= 2
    assert [r["accepted"] for r in as_k["per_request"]] != [r["accepted"] for r in trained["per_request"]]


def test_a_reduced_vocabulary_trains_over_the_tokens_the_target_predicts_most(scorer_cache, tmp_path):
    """train_eagle3 with draft_vocab_size below the target's (SpecForge's d2t/t2d): the draft vocabulary
    is the target's most predicted tokens in the cache, the loss is over draft ids (a token outside it
    is no class), and the saved drafter drafts only inside it and is accepted. (It was an IndexError,
    "Target 266 is out of bounds", from the loss.)"""
    from safetensors.torch import load_file

    from scorer.families.eagle3.train import draft_vocabulary, train_eagle3

    # hand-made: counts 9: 3, 5: 2, 2: 2, 7: 1 -> the 3 most predicted, ascending; a tie keeps the lower id
    d2t, to_draft = draft_vocabulary([torch.tensor([5, 5, 2, 9, 9, 9]), torch.tensor([2, 7])], 10, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9]
    assert to_draft.tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, -1, 2]
    assert draft_vocabulary([torch.tensor([1])], 10, 10)[0] is None  # the full vocabulary has no map

    view = hscache.open_cache(scorer_cache)
    out = tmp_path / "reduced"
    train_eagle3(scorer_cache, out, steps=30, layout="specforge", draft_vocab_size=64, layer_ids=[1, 3, 7])
    saved = load_file(out / "model.safetensors")
    want, _ = draft_vocabulary([view.target_argmax(r) for r in range(len(view))], view.vocab_size, 64)
    assert torch.equal(saved["d2t"], want) and int(saved["t2d"].sum()) == 64
    report = evaluate(out, scorer_cache, EvalConfig(num_speculative_tokens=3, ddtree=(), n_boot=10))
    assert report["tau"]["pooled"] > 1.2  # 2.26 measured; the untrained init_eagle3 drafter: 1.00


def test_a_specforge_export_is_replayed_on_the_layers_each_engine_feeds_it(
    diagnose_cache, scorer_cache, tmp_path
):
    """SpecForge names an EAGLE-3's layers only in ``eagle_config`` (SGLang ids: id i = output of layer
    i). vllm 0.32.0 reads them as its own aux ids (id k = output of layer k-1; v1/worker/
    gpu_model_runner.py:5268-5283), so it serves such a drafter one layer lower (measured by the judge,
    docs/families.md). The chain (vLLM's) is replayed on the layers vLLM feeds, equal to the same
    weights configured on those layers; SGLang's tree on the trained ones. This project's export adds a
    top-level ``eagle_aux_hidden_state_layer_ids``, which vLLM reads first and SGLang never reads: with
    it both engines feed the trained layers."""
    from scorer.diagnose.run import DiagnoseConfig, diagnose_checkpoint
    from scorer.families.eagle3.train import train_eagle3

    ours = tmp_path / "ours"
    train_eagle3(
        diagnose_cache, ours, steps=200, layout="specforge", layer_ids=[1, 3, 7], num_speculative_tokens=3
    )
    written = json.loads((ours / "config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    theirs = shutil.copytree(ours, tmp_path / "theirs")  # as SpecForge writes it: no top-level ids
    (theirs / "config.json").write_text(
        json.dumps({k: v for k, v in written.items() if k != "eagle_aux_hidden_state_layer_ids"})
    )
    lower = shutil.copytree(ours, tmp_path / "lower")  # the same weights, trained-on layers 0, 2, 6
    (lower / "config.json").write_text(
        json.dumps(
            {**written, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}}
            | {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}
        )
    )
    assert read_eagle3(ours, num_target_layers=8)[0].vllm_layer_ids is None
    config, _, _, loaded = read_eagle3(theirs, num_target_layers=8)
    assert config.target_layer_ids == (1, 3, 7) and config.vllm_layer_ids == (0, 2, 6)
    assert any(
        "serves this drafter on target layers [0, 2, 6]" in n
        and '"eagle_aux_hidden_state_layer_ids": [2, 4, 8]' in n
        for n in loaded.notes
    ), loaded.notes
    eval_config = EvalConfig(n_boot=10, ddtree=(), tree=(3, 2, 4), limit=8)
    reports = {c.name: evaluate(c, diagnose_cache, eval_config) for c in (ours, theirs, lower)}
    accepted = {name: [r["accepted"] for r in rep["per_request"]] for name, rep in reports.items()}
    assert accepted["theirs"] == accepted["lower"]  # the chain on the layers vLLM feeds it
    assert accepted["theirs"] != accepted["ours"]  # ... which this drafter tells apart
    assert reports["theirs"]["tree"]["tau"] == reports["ours"]["tree"]["tau"]  # SGLang's tree: trained layers
    assert reports["theirs"]["tree"]["tau"] != reports["lower"]["tree"]["tau"]
    # scorer diagnose replays vLLM's chain: the one-layer shift is its finding (+0.34 [+0.16, +0.59]
    # measured 2026-12-04), the fix the note names
    diagnosis = diagnose_checkpoint(str(theirs), [diagnose_cache], DiagnoseConfig(num_speculative_tokens=3))
    assert diagnosis["finding"] is not None, diagnosis["verdict"]
    assert (diagnosis["finding"]["kind"], diagnosis["finding"]["value"]) == ("layer_ids", 1)
    assert diagnosis["finding"]["ci"][0] > 0.05
    # A cache without the layers vLLM feeds: one line naming both fixes.
    result = CliRunner().invoke(main, ["eval", str(theirs), "--cache", str(scorer_cache)])
    line = result.output.strip()
    assert result.exit_code == 2 and "\n" not in line, result.output
    assert "vLLM-served layers [0, 2, 6]" in line and "--layers 0,1,2,3,6,7" in line
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 8]' in line
