"""Does a DFlash drafter read its anchor token? Slot 1 (the token after the anchor) with its inputs taken
away one at a time, on the sequences of a cache, against an in-sample bigram table.

A DFlash block at anchor p holds the anchor token x_p and mask tokens; its context is the target's
features of positions < p, which already encode x_p (the target predicted it there). To draft x_{p+1}
the drafter must combine the two. Printed, as slot-1 accuracy (draft == x_{p+1}) over every anchor of
the first ``--limit`` sequences:

- real: the drafter as served;
- random anchor: each block's x_p replaced by a random token (a drafter that reads its anchor drops);
- zero context / shuffled context: the target's features zeroed, or their rows permuted;
- bigram: the most frequent follower of x_p in the cache's generated text (in-sample: an upper bound
  on what x_p alone gives there).

    python bench/dflash_anchor.py DRAFTER --cache CACHE [--limit 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    import hscache
    from scorer.families.dflash.features import feature_index
    from scorer.offline.scoring import EvalConfig, load_drafter
    from scorer.offline.sequences import sequence_features

    gen = torch.Generator().manual_seed(args.seed)
    cache = hscache.open_cache(args.cache)
    drafter, _ = load_drafter(args.drafter, cache, EvalConfig())
    if drafter.family != "dflash":
        raise SystemExit(f"{args.drafter} is a {drafter.family} drafter; this probe reads DFlash blocks")
    index, B = feature_index(drafter.config, cache.layer_ids), drafter.config.block_size
    prompt_lens = cache.index.column("prompt_len").to_pylist()
    followers: dict[int, Counter] = defaultdict(Counter)
    for row in range(len(cache)):
        x = cache.token_ids(row).tolist()
        for a, b in zip(x[prompt_lens[row] : -1], x[prompt_lens[row] + 1 :]):
            followers[a][b] += 1
    hits = Counter()
    anchors_seen = 0
    for row in range(min(args.limit, len(cache))):
        x = cache.token_ids(row)
        anchors = torch.arange(prompt_lens[row], len(x) - 1)
        if not len(anchors):
            continue
        features = sequence_features(
            cache.hidden_states(row), index, torch.float32, "cpu", drafter.context_norm
        )
        blocks = torch.full((len(anchors), B), drafter.config.mask_token_id)
        blocks[:, 0] = x[anchors]
        want = x[anchors + 1]

        def slot1_hits(feats, blk, anchors=anchors, want=want) -> int:
            with torch.no_grad():
                hidden = drafter.block_hidden(feats, anchors, blk)
                return int((drafter.head(hidden[:, 0]).argmax(-1) == want).sum())

        random_anchor = blocks.clone()
        random_anchor[:, 0] = torch.randint(0, cache.vocab_size, (len(anchors),), generator=gen)
        shuffled = features[torch.randperm(len(features), generator=gen)]
        hits["real"] += slot1_hits(features, blocks)
        hits["random anchor"] += slot1_hits(features, random_anchor)
        hits["zero context"] += slot1_hits(torch.zeros_like(features), blocks)
        hits["shuffled context"] += slot1_hits(shuffled, blocks)
        hits["bigram (in-sample)"] += sum(
            int(bool(followers[int(a)]) and followers[int(a)].most_common(1)[0][0] == int(w))
            for a, w in zip(x[anchors], want)
        )
        anchors_seen += len(anchors)
    rates = {name: count / max(anchors_seen, 1) for name, count in hits.items()}
    print(f"slot-1 accuracy over {anchors_seen} anchors of {args.cache} ({args.drafter}):")
    for name, rate in rates.items():
        print(f"  {name:<20} {rate:.3f}")
    return rates


if __name__ == "__main__":
    main()
