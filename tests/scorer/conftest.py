"""Fixtures for stage two: a trained tiny drafter on a small fp32 cache of the built-in target."""

from __future__ import annotations

from pathlib import Path

import pytest

import hscache
from hscache.capture.final_norm import KINDS
from scorer import train_drafter


@pytest.fixture(scope="session")
def scorer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scorer") / "cache"
    hscache.extract(
        hscache.ExtractConfig(out=str(out), layers="1,3,7", max_new_tokens=24, dtype="fp32", limit=6)
    )
    return out


@pytest.fixture(scope="session")
def qwen3_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plain Qwen3 built-in target (attention only), fp32, 2 prompts x 16 greedy tokens, layers
    1,3,4,7 (DFlash's 1,3,7 and EAGLE-3's engine default 1,3,4): the online == offline tests of
    test_online.py, test_eagle3.py and test_dflash2.py on that target share it."""
    out = tmp_path_factory.mktemp("scorer") / "qwen3"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out),
            model="builtin:tiny-qwen3",
            layers="1,3,4,7",
            max_new_tokens=16,
            dtype="fp32",
            limit=2,
        )
    )
    return out


@pytest.fixture(scope="session")
def sampled_scorer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scorer_cache``'s first 3 prompts (layers 1,3,7, fp32, the MTP head) sampled at Qwen's
    thinking-coding preset (T 0.6, top-p 0.95, top-k 20, no penalty), 2 samples x 16 tokens, seed 3:
    every drafter fixture here scores it (tests/scorer/test_served.py)."""
    from hscache.store.sampling import SamplingSetting

    out = tmp_path_factory.mktemp("scorer") / "sampled"
    sampling = SamplingSetting.from_flags("qwen-thinking-coding", samples_per_prompt=2, seed=3)
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="1,3,7", max_new_tokens=16, dtype="fp32", limit=3, sampling=sampling
        )
    )
    return out


@pytest.fixture(scope="session")
def qwen3_drafter(qwen3_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFlash drafter (block 5, 120 steps) trained on ``qwen3_cache``: the online == offline tests on the
    plain Qwen3 target (test_online.py, and test_dflash2.py's identity start around it) share it."""
    out = tmp_path_factory.mktemp("scorer") / "qwen3_drafter"
    train_drafter(qwen3_cache, out, steps=120, block_size=5, log_every=0)
    return out


@pytest.fixture(scope="session")
def trained_drafter(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scorer") / "drafter"
    # loss_decay_gamma 6 (= the block): the slot weights the tests on this drafter were calibrated with
    # (the trainer's default until 2026-12-04, block / 2 since); at 3 its tau on the sampled cache falls
    # to ~1.07, where sampled and argmax replays coincide (test_diagnose_families.py) and DDTree-2
    # drafts what the block does (test_served_vs_online.py). prompt_anchors False: generated anchors
    # only, the trainer's default until 2026-12-07, which the ~24 test files on this drafter were
    # calibrated with; trained also at prompt anchors (the default since) its DDTree-2 on
    # test_served_vs_online.py's prompt never branches (0 of the online rounds: no tree to test).
    train_drafter(
        scorer_cache, out, steps=150, block_size=6, log_every=0, loss_decay_gamma=6, prompt_anchors=False
    )
    return out


@pytest.fixture(scope="session")
def eagle3_drafter(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly trained 1-layer EAGLE-3 (speculators layout, layers 1,3,7, K=3) for the cache."""
    from scorer.families.eagle3.train import train_eagle3

    out = tmp_path_factory.mktemp("scorer") / "eagle3"
    train_eagle3(scorer_cache, out, steps=25, layer_ids=[1, 3, 7])
    return out


# ---- scorer diagnose: tiny drafters trained under a planted convention ---------------------------
# The smallest cache found to give clear gaps (see docs/diagnose.md): all 8 layers of the built-in
# target (so layer ids can shift by 1), 16 prompts x 32 greedy tokens; block 8, seed 0. The clean
# drafter: 600 steps of 32 anchors from random weights (on the trained built-in target 300 x 64 left
# tau 2.5 and the layer plant at +0.00, and 450 x 32 left tau 3.3 with a false mask-id finding: the
# drafter had not learnt to read the target yet; 600 x 32: clean tau 5.5). A plant trained under
# another convention is the clean drafter fine-tuned under it (``init_from``; its steps below):
# a third of the CPU of 600 steps from scratch, and found with a wider margin (docs/diagnose.md).
CLEAN_STEPS = 600
PLANTS: dict[str, tuple[dict, dict, int]] = {
    # name: (train_drafter settings, config.json dflash_config fields rewritten afterwards,
    #        fine-tuning steps from the clean drafter; 0: the clean weights themselves)
    "clean": ({}, {}, 0),
    # 40 steps: +3.39 [+2.50, +4.43] on all 16 sequences, the lower end where 100 steps put it
    # (+3.92 [+2.60, +5.36], docs/diagnose.md's row), in 1.0 CPU-s instead of 2.1
    "positions+1": ({"block_position_offset": 1}, {}, 40),
    # The clean weights (trained with the cache's mask id 3, <|mask|>), their config saying 0
    # (<|endoftext|>), as a conversion that writes the pad/eos id gets it wrong: measured 2026-12-07 on
    # all 16 sequences, the finding `mask_token_id 3` for clean seeds 0/1/2 with interval lower ends
    # +0.94/+1.35/+0.86 (gains +1.79/+1.86/+1.49), ahead of the runner-up mask id beyond its interval.
    # Until 2026-12-07 this plant was 400 steps from random weights under mask 2 with config 3 (5.3
    # CPU-s; lower ends 0.87/0.16/0.16/0.07 over seeds 0-3, an inconclusive verdict for three of them):
    # the clean drafter fine-tuned under mask 2 kept working with mask 3, so that plant needed its own
    # training; a config rewrite of the clean weights needs none.
    "mask0": ({}, {"mask_token_id": 0}, 0),
    "layers": ({}, {"target_layer_ids": [0, 2, 6]}, 0),  # trained on [1, 3, 7]: the config is one off
    # 150 steps (was 250): measured 2026-12-07 on all 16 sequences, finding final_norm pre with interval
    # lower ends 125: +0.90, 150: +1.20, 175: +0.99, 200: +1.00, 250: +0.74 (100: +0.03): 150 sits
    # inside the plateau, clear of the 0.05 the test asks, in 1.7 CPU-s less than 250
    "prenorm": ({"last_layer_normed": False}, {}, 150),
}


@pytest.fixture(scope="session")
def diagnose_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("diagnose") / "cache"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="0,1,2,3,4,5,6,7", max_new_tokens=32, dtype="fp32", limit=16
        )
    )
    return out


@pytest.fixture(scope="session")
def planted_drafter(diagnose_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> a drafter trained on ``diagnose_cache`` under ``PLANTS[name]`` (trained on first use:
    the clean drafter, then a plant's fine-tuning from it; plants that differ only in their
    rewritten config share one training)."""
    import json
    import shutil

    root, trained, made = tmp_path_factory.mktemp("planted"), {}, {}
    # loss_decay_gamma 8: the slot weights docs/diagnose.md's table was measured with (the trainer's
    # default until 2026-12-04); at 4 the prenorm plant is inconclusive on the CLI test's 6 sequences.
    common = {"anchors_per_step": 32, "block_size": 8, "log_every": 0, "layer_ids": [1, 3, 7]}
    common["loss_decay_gamma"] = 8

    def get(name: str) -> Path:
        if name not in made:
            settings, rewrite, steps = PLANTS[name]
            key = json.dumps(settings, sort_keys=True)
            if "{}" not in trained:
                trained["{}"] = root / "clean_weights"
                train_drafter(diagnose_cache, trained["{}"], steps=CLEAN_STEPS, **common)
            if key not in trained:
                trained[key] = root / f"trained{len(trained)}"
                start = {"init_from": trained["{}"]}
                train_drafter(diagnose_cache, trained[key], steps=steps, **start, **common, **settings)
            out = root / name
            shutil.copytree(trained[key], out)
            config = json.loads((out / "config.json").read_text())
            config["dflash_config"].update(rewrite)
            (out / "config.json").write_text(json.dumps(config))
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def diagnose_eagle3(diagnose_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer EAGLE-3 (speculators layout, layers 1,3,7, K=3) trained 200 steps on
    ``diagnose_cache``: tau 3.47 there, clear of the rope-theta and d2t plants of test_diagnose_families
    (2.5 CPU-s; 25 steps, ``eagle3_drafter``'s, leave tau 1.16, too close to 1 for any plant)."""
    from scorer.families.eagle3.train import train_eagle3

    out = tmp_path_factory.mktemp("diagnose") / "eagle3"
    train_eagle3(diagnose_cache, out, steps=200, layer_ids=[1, 3, 7], num_speculative_tokens=3)
    return out


# ---- scorer diagnose: the target's MTP head, trained ---------------------------------------------
# The built-in head is random (tau 1.01) and the built-in final norm has unit weights, so neither a
# trained-vs-served convention nor anything else can show on it. ``trained_mtp_cache`` is a copy of
# ``diagnose_cache`` whose target is the same function reparametrised (final norm (1 + w) = s per
# channel, non-unit; lm_head = embed / s: the logits, so every cached argmax, are the same up to
# rounding, which the fixture checks) and whose target/mtp.safetensors is the head trained on it.
MTP_NORM_SPREAD = 1.0  # s = exp(N(0, 1)): channels scaled 0.07-30x (seed 0)
# Step 0 only (K = 1): 20 full-batch steps at 1e-2 (was 50 at 3e-3: 1.9 CPU-s more): tau 1.93 of at most
# 2, the plant's finding `final_norm post` for norm seeds 0/1/2 (reparametrise_final_norm) at +0.29
# [+0.24, +0.35], +0.20 [+0.14, +0.26], +0.15 [+0.10, +0.20] (50 at 3e-3: lower ends +0.17, +0.15,
# +0.11; measured 2026-12-07, all 16 sequences, n_boot 300)
MTP_TRAIN_STEPS, MTP_TRAIN_LR = 20, 1e-2


def reparametrise_final_norm(root: Path, spread: float, seed: int = 0) -> None:
    """Give the cache's target at ``root`` a final norm scaled by s per channel and the head
    lm_head / s (untied): the target's logits are unchanged; then reseal the manifest over target/."""
    import json

    import torch
    from safetensors.torch import save_file

    head = hscache.open_cache(root).target_head()
    assert KINDS[int(head["final_norm.kind"][0])] == "rms_one_plus_weight"  # Qwen3.5: n * (1 + w)
    embed = head["embed_tokens"]
    s = torch.exp(spread * torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(seed)))
    # the trained targets' final norm is not unit already ((1 + w0) != 1) and their head may be
    # untied: scale the norm they have by s and divide the head they have by s
    scale = (1 + head["final_norm.weight"].float()) * s
    tensors = {
        "embed_tokens": embed.contiguous(),
        "lm_head": (head["lm_head"] / s).contiguous(),
        "final_norm.weight": scale - 1,
        "final_norm.eps": head["final_norm.eps"],
        "final_norm.kind": head["final_norm.kind"],
    }
    save_file(tensors, str(root / "target" / "head.safetensors"), metadata={"tied": "false"})
    config = json.loads((root / "target" / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (root / "target" / "config.json").write_text(json.dumps(config, indent=2))
    reseal_target(root)


def reseal_target(root: Path) -> None:
    """Record target/'s rewritten files in the manifest and reseal it (as re-extracting would)."""
    import json

    from hscache.store import integrity

    manifest = json.loads((root / "manifest.json").read_text())
    for rel in [r for r in manifest["checksums"] if r.startswith("target/")]:
        manifest["checksums"][rel] = integrity.digest_file(root / rel)
    integrity.seal(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))


def train_mtp_head(root: Path, *, post_norm: bool, steps: int, lr: float = 3e-3) -> dict:
    """Fit the cache's MTP head (``mtp.*`` tensors) where ``target:mtp`` drafts its first token:
    row i of a sequence pairs the target's last layer at i (after the final norm when
    ``post_norm``, as vLLM serves it; before it otherwise, as speculators trains) with token i + 1 at
    position i, causally over the sequence, and is labelled with the target's argmax at i + 1 (the
    token at i + 2). Full batch (every row of every sequence, padded), Adam; the embedding and
    lm_head are the target's and stay fixed. An independent batched forward of the head's own
    modules (scorer/families/mtp/draft.py's ``mtp_context`` is one sequence at a time)."""
    import torch
    import torch.nn.functional as F

    from scorer.offline.scoring import EvalConfig, load_drafter
    from scorer.offline.sequences import cache_final_norm

    cache = hscache.open_cache(root)
    head, _ = load_drafter("target:mtp", cache, EvalConfig(num_speculative_tokens=1))
    final_norm = cache_final_norm(cache)
    last = cache.layer_ids.index(head.config.num_target_layers - 1)
    S, L = len(cache), max(len(cache.token_ids(r)) for r in range(len(cache)))
    hidden = torch.zeros(S, L, head.config.hidden_size)
    fed = torch.zeros(S, L, dtype=torch.long)  # token i + 1 at row i
    labels = torch.full((S, L), -100, dtype=torch.long)  # argmax at i + 1; -100 past the end
    for r in range(S):
        states, tokens, argmax = cache.hidden_states(r)[:, last], cache.token_ids(r), cache.target_argmax(r)
        n = len(tokens) - 1
        hidden[r, :n] = (final_norm(states) if post_norm else states)[:n]
        fed[r, :n], labels[r, :n] = tokens[1:], argmax[1:]
    layer, D = head.layers[0], head.config.head_dim
    positions = torch.arange(L).repeat(S)
    head.train()
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)

    def per_sequence(t: torch.Tensor) -> torch.Tensor:  # [S * L, h, D] -> [S, h, L, D], kv expanded
        return (
            t.repeat_interleave(head.config.num_attention_heads // t.shape[1], 1)
            .view(S, L, -1, D)
            .transpose(1, 2)
        )

    for _ in range(steps):  # full batch, no dropout, no new weights: deterministic
        x = head.fuse(fed.flatten(), hidden.flatten(0, 1))
        q, gate, k, v = layer.self_attn.project(layer.input_layernorm(x), *head.cos_sin(positions, x.dtype))
        attn = F.scaled_dot_product_attention(
            per_sequence(q), per_sequence(k), per_sequence(v), is_causal=True
        )
        out = head.norm(layer.finish(x, attn.transpose(1, 2).flatten(0, 1), gate))
        loss = F.cross_entropy(head.logits(out), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}


@pytest.fixture(scope="session")
def trained_mtp_cache(diagnose_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``diagnose_cache`` copied with its target's final norm reparametrised to non-unit weights
    (the same target function) and its MTP head trained on the target's last layer AFTER the final
    norm, as vLLM serves it: ``target:mtp`` is this head as trained, ``target:mtp-prenorm`` the
    same weights fed the layer before the norm (the plant)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from scorer.offline.sequences import cache_final_norm

    out = tmp_path_factory.mktemp("diagnose") / "trained_mtp"
    shutil.copytree(diagnose_cache, out)
    before = hscache.open_cache(out)
    norm0, head0 = cache_final_norm(before), before.target_head()["lm_head"]
    last = before.layer_ids.index(before.target_config["num_hidden_layers"] - 1)
    logits0 = [norm0(before.hidden_states(r)[:, last]) @ head0.T for r in range(len(before))]
    reparametrise_final_norm(out, MTP_NORM_SPREAD)
    cache = hscache.open_cache(out)
    final_norm, lm_head = cache_final_norm(cache), cache.target_head()["lm_head"]
    for r in range(len(cache)):  # the same target function: the same logits up to rounding
        logits = final_norm(cache.hidden_states(r)[:, last]) @ lm_head.T
        assert torch.allclose(logits, logits0[r], rtol=1e-4, atol=1e-4)
        # and the cached argmax is the top logit, but for near-ties a rounding can swap (a trained
        # target has some: top-2 margins under 1e-4)
        top = logits.gather(-1, cache.target_argmax(r)[:, None].long())[:, 0]
        assert torch.all(logits.max(-1).values - top <= 1e-4)
    save_file(
        train_mtp_head(out, post_norm=True, steps=MTP_TRAIN_STEPS, lr=MTP_TRAIN_LR),
        str(out / "target" / "mtp.safetensors"),
    )
    reseal_target(out)
    return out
