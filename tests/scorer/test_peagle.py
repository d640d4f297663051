"""P-EAGLE (scorer/families/peagle/): what ``scorer init --family peagle`` writes, and its drafts as vLLM
0.32.0 lays out parallel drafting. The batched replay (EAGLE-3's drafting with `PEagleDrafter.step`) equals
the literal one-anchor first pass (`PEagleDrafter.draft_one_anchor`: rows and mask slots in one causal
forward) at every anchor; the EAGLE-3 chain rule or the parallel slots one position late do not. vLLM's
own judgement of the same family: tests/judge/test_peagle_judged.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import hscache
from scorer.cli import main
from scorer.families import family_for, probe_checkpoint
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.families.peagle.model import PEagleDrafter
from scorer.families.peagle.seam import init
from scorer.offline.scoring import EvalConfig, load_drafter
from scorer.offline.sequences import sequence_features
from tests.scorer.family_contract import FamilyContract

K = 3


@pytest.fixture(scope="module")
def peagle(qwen3_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("peagle") / "drafter"
    init(qwen3_cache, out, num_speculative_tokens=K, mask_token_id=5)
    return out


def test_init_writes_speculators_peagle_layout(peagle, qwen3_cache):
    config = json.loads((peagle / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 5 and config["speculators_config"]["algorithm"] == "peagle"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM ids of layers 1, 3, 4
    hidden = json.loads((qwen3_cache / "target" / "config.json").read_text())["hidden_size"]
    with safe_open(str(peagle / "model.safetensors"), framework="pt") as f:
        assert list(f.get_tensor("mask_hidden").shape) == [1, 1, 3 * hidden]  # vLLM: view(1, -1)
    assert family_for(probe_checkpoint(peagle)).name == "peagle"


def _slot_logits(drafter, cache, row=0):
    """[A, K, V] every anchor's slot logits two ways: the batched replay (EAGLE-3's step 0 over the sequence,
    then ``drafter.step`` for slots 2..K, fed what EAGLE-3's chain feeds: its own drafts and states) and the
    literal one-forward first pass (``draft_one_anchor``, its logits caught by ``draw``)."""
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, torch.float32, "cpu", None)
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    ids = cache.token_ids(row)
    with torch.no_grad():
        normed0, fed0, kv0 = drafter.step0(features, ids, len(ids) - 2)
        rows = torch.arange(prompt_len - 1, len(ids) - 2)
        slots = [drafter.head_logits(normed0[rows])]
        fed, own = fed0[rows], [[] for _ in drafter.layers]
        for j in range(1, K):
            normed, fed = drafter.step(rows, drafter.to_target(slots[-1].argmax(-1)), fed, j, kv0, own)
            slots.append(drafter.head_logits(normed))
    caught = []

    def catch(logits):
        caught.append(logits)
        return int(logits.argmax())

    for p in range(prompt_len, len(ids) - 1):
        drafter.draft_one_anchor(features, ids, p, K, draw=catch)
    return torch.stack(slots, dim=1), torch.stack(caught).view(len(rows), K, -1)


def test_batched_drafts_equal_vllms_one_forward_layout(peagle, qwen3_cache, monkeypatch):
    """fp32 both ways, the same math in another order: within 1e-5 (a misplaced slot moves them ~1e-2)."""
    cache = hscache.open_cache(qwen3_cache)
    drafter, _ = load_drafter(str(peagle), cache, EvalConfig(ddtree=()))
    assert isinstance(drafter, PEagleDrafter) and drafter.pard_token == 5
    batched, reference = _slot_logits(drafter, cache)
    assert batched.shape[0] > 10
    torch.testing.assert_close(batched, reference, rtol=1e-5, atol=1e-5)
    drafter.step_position_offset = 1  # the parallel slots one position late
    late, _ = _slot_logits(drafter, cache)
    torch.testing.assert_close(late[:, 0], reference[:, 0], rtol=1e-5, atol=1e-5)  # slot 1: step 0's row
    assert (late[:, 1:] - reference[:, 1:]).abs().max() > 1e-3
    drafter.step_position_offset = 0
    monkeypatch.setattr(
        PEagleDrafter, "step_inputs", Eagle3Drafter.step_inputs
    )  # EAGLE-3's chain: its drafts fed back
    chain, _ = _slot_logits(drafter, cache)
    assert (chain[:, 1:] - reference[:, 1:]).abs().max() > 1e-3


def test_what_vllm_would_not_serve_is_refused_by_name(peagle, qwen3_cache, tmp_path):
    for key, value, said in (
        ("mask_token_id", None, "no mask_token_id in its config"),
        ("fc_norm", True, "fc_norm set, which vLLM 0.32.0 does not pass to a peagle drafter"),
    ):
        other = tmp_path / key
        other.mkdir()
        for f in peagle.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        config = json.loads((other / "config.json").read_text())
        config[key] = value
        (other / "config.json").write_text(json.dumps(config))
        result = CliRunner().invoke(main, ["eval", str(other), "--cache", str(qwen3_cache)])
        assert result.exit_code == 2 and said in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def peagle_from_eagle3(eagle3_drafter, tmp_path_factory):
    """The session's trained EAGLE-3 (scorer_cache) as a P-EAGLE directory: its step 0 (slot 1, often
    accepted) plus a learned-looking ``mask_hidden`` and mask token for the parallel slots."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("peagle") / "from_eagle3"
    shutil.copytree(eagle3_drafter, out)
    config = json.loads((out / "config.json").read_text())
    config.update(speculators_model_type="peagle", architectures=["PEagleSpeculator"], mask_token_id=5)
    config["speculators_config"]["algorithm"] = "peagle"
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    width = tensors["fc.weight"].shape[1]
    tensors["mask_hidden"] = torch.randn(1, 1, width, generator=torch.Generator().manual_seed(0))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class TestPEagleOnline:
    """``scorer online`` with a P-EAGLE drafter (its proposer: EAGLE-3's, drafting with P-EAGLE's
    one-forward first pass) drafts round for round what the offline replay drafted: the family
    contract's online == offline case (tests/scorer/family_contract.py), on the live target."""

    family = "peagle"
    config = FamilyContract.config
    test_online_equals_offline_round_for_round = FamilyContract.test_online_equals_offline_round_for_round

    @pytest.fixture
    def checkpoint(self, peagle_from_eagle3):
        return str(peagle_from_eagle3)
