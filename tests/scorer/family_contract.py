"""What every drafter family must do on the seam, as one set of tests (like CacheViewContract for
the store): a family's test module subclasses `FamilyContract`, gives its checkpoint, and inherits

- online == offline round for round (``scorer online``'s loop with the target verifying drafts,
  round by round, what the cache replay drafted, and the rounds commit the same tokens);
- a wrong checkpoint refused in one line naming the problem;
- the target identity check (the report's ``target_check``);
- compare pairing (the drafter against itself: the same rounds, a zero delta over every request);
- the cost keys of ``scorer compare``;
- a timed round (``Family.time_round``) drafts what the replay drafted at that anchor.

Everything runs on the session's ``scorer_cache`` (tiny-qwen3.5, layers 1,3,7, 24 new tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import hscache
from hscache.store.dtypes import DTYPES
from scorer.cli import main
from scorer.families.base import OnlineOptions
from scorer.offline.scoring import drafter_family, load_drafter
from scorer.offline.sequences import sequence_features
from scorer.studies.compare import compare_drafters
from scorer.studies.evaluate import EvalConfig, evaluate

ROWS = 2  # sequences the cheaper checks score


def checkpoint_without_a_tensor(source: str | Path, out: Path) -> Path:
    """A copy of the HF directory ``source`` whose safetensors lack the first tensor of a layer."""
    out.mkdir()
    for path in Path(source).iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            tensors.pop(next(k for k in sorted(tensors) if "layers." in k))
            save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        elif path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    return out


def _drafted(row: np.ndarray) -> list[int]:
    """A replay's draft row without its padding (a proposer that drafts fewer than K pads with -1)."""
    return [int(t) for t in row if t >= 0]


class FamilyContract:
    """Subclass per family; override the fixture ``checkpoint`` and the class attributes."""

    family: str = ""
    config: EvalConfig = EvalConfig(ddtree=(), n_boot=10)
    target_status: str = "match"  # what the report's target_check says for ``checkpoint``

    @pytest.fixture
    def checkpoint(self) -> str:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def wrong_checkpoint(self, checkpoint: str, tmp_path: Path) -> tuple[list[str], str]:
        """(``scorer eval`` arguments naming a wrong checkpoint of this family, a phrase of the refusal)."""
        return [str(checkpoint_without_a_tensor(checkpoint, tmp_path / "broken"))], "missing"

    def test_online_equals_offline_round_for_round(self, scorer_cache, checkpoint):
        from hscache.capture.prompts import iter_records, prompt_token_ids, resolve_prompts
        from hscache.capture.target import load_target
        from scorer.online.greedy import speculative_decode

        cache = hscache.open_cache(scorer_cache)
        drafter, _ = load_drafter(checkpoint, cache, self.config)
        family = drafter_family(drafter)
        assert family.name == self.family
        offline = family.score_rows(drafter, cache, [0], family.effective_config(self.config))[0]
        target = load_target("builtin:tiny-qwen3.5", "fp32")  # the cache's target, fp32 as the cache
        options = OnlineOptions(
            overrides=dict(self.config.overrides), num_speculative_tokens=self.config.num_speculative_tokens
        )
        layer_ids, propose, _ = family.online(checkpoint, target, options)
        drafts = []

        def recording(hidden, ids, p):
            drafts.append(propose(hidden, ids, p))
            return drafts[-1]

        record = next(iter_records(resolve_prompts("builtin:default")))
        prompt = prompt_token_ids(record, target.tokenizer)
        ids, rounds = speculative_decode(target, layer_ids, recording, prompt, 24, 4096)
        assert ids == cache.token_ids(0).tolist()  # the same text
        assert [list(d) for d in drafts] == [_drafted(row) for row in offline.chain_drafts]
        assert rounds == list(offline.chain.tokens)

    def test_a_wrong_checkpoint_is_refused_in_one_line(self, scorer_cache, checkpoint, tmp_path):
        args, phrase = self.wrong_checkpoint(checkpoint, tmp_path)
        flags = [
            "--ddtree",
            "",
            *(["--num-speculative-tokens", "3"] if self.config.num_speculative_tokens else []),
        ]
        for key, value in self.config.overrides.items():
            flags += [f"--{key.replace('_', '-')}", str(value)]
        result = CliRunner().invoke(main, ["eval", *args, "--cache", str(scorer_cache), *flags])
        assert result.exit_code == 2, result.output
        assert phrase in result.output and len(result.output.strip().splitlines()) == 1

    def test_target_identity_is_checked(self, scorer_cache, checkpoint):
        config = EvalConfig(**{**self.config.__dict__, "limit": 1})
        report = evaluate(checkpoint, scorer_cache, config)
        assert report["drafter"]["family"] == self.family
        assert report["target_check"]["status"] == self.target_status

    def test_compare_pairs_the_drafter_with_itself(self, scorer_cache, checkpoint):
        config = EvalConfig(**{**self.config.__dict__, "limit": ROWS})
        document = compare_drafters([checkpoint, checkpoint], scorer_cache, config, timed_rounds=2)
        first, second = document["drafters"]
        assert first["tau"] == second["tau"] and first["rounds"] == second["rounds"]
        delta = second["delta_vs_first"]
        assert delta["requests_compared"] == ROWS and delta["pooled"]["delta"] == 0.0
        json.dumps(document)  # the document is plain JSON

    def test_cost_keys(self, scorer_cache, checkpoint):
        drafter, _ = load_drafter(checkpoint, hscache.open_cache(scorer_cache), self.config)
        family = drafter_family(drafter)
        if family.cost is None:  # a proposer without weights has no serving estimate
            assert sum(p.numel() for p in drafter.parameters()) == 0
            return
        cost = family.cost(drafter, 2.0, 12.0)
        assert set(cost) == {"draft_forwards_per_round", "flops_per_round"}
        assert cost["draft_forwards_per_round"] >= 1 and cost["flops_per_round"] > 0
        # more context costs more attention: the estimate reads its arguments
        assert family.cost(drafter, 2.0, 100.0)["flops_per_round"] > cost["flops_per_round"]

    def test_a_timed_round_drafts_what_the_replay_drafted(self, scorer_cache, checkpoint):
        cache = hscache.open_cache(scorer_cache)
        drafter, _ = load_drafter(checkpoint, cache, self.config)
        family = drafter_family(drafter)
        offline = family.score_rows(drafter, cache, [0], family.effective_config(self.config))[0]
        index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
        norm = getattr(drafter, "context_norm", None)
        features = sequence_features(cache.hidden_states(0), index, DTYPES[self.config.dtype], "cpu", norm)
        tokens = cache.token_ids(0)
        checked = 0
        for n, anchor in enumerate(offline.chain.anchors[:3]):
            with torch.no_grad():
                seconds, drafts = family.time_round(drafter, features, tokens, anchor, 1.0)
            assert seconds >= 0 and drafts == _drafted(offline.chain_drafts[n])
            checked += 1
        assert checked >= 2
