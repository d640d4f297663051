"""Each serving engine's verification rule, as pure functions: drafts and the target's processed
distribution (or its sampled tokens) in, accepted counts out.

``onehot_chain``: the one-hot chain rule (every engine's default: the longest prefix of drafts equal
to the target's tokens; vLLM ``rejection_greedy_sample_kernel``) and ``RoundLog``, the record of a
sequence's rounds. ``onehot_tree``: the one-hot tree walk (SGLang ``verify_tree_greedy``; the EAGLE
tree, DDTree). ``vllm_chain``: vLLM's probabilistic chain round (rejection sampling, min(1, p/q), the
recovered-token draw; ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py`` and
``vllm/v1/sample/rejection_sampler.py``, vLLM v0.33.0). ``sglang_tree``: SGLang's target-only tree rule
(``sgl-kernel/csrc/speculative/speculative_sampling.cuh``, commit b227f632) and the z-lab reference
(``dflash/model.py``, snapshot 44947fbf). ``block_verify``: vLLM's block verification (``rejection_sample_method="block"``, Sun et al.).
``penalties``: which tokens a row's penalties count (vLLM
in-round, SGLang relaxed) and the processed distribution of a round's rows. ``expectation``: the exact
expectation (the DP) of the one-hot and probabilistic rules over a sampled cache, and the one-hot
acceptance. The offline replay (scorer/offline/) and the online loop (scorer/online/) call these;
nothing here imports a family, the offline replay or the online loop (tests/test_architecture.py).
"""

__all__ = ["DRAFT_SAMPLE_METHODS", "REJECTION_SAMPLE_METHODS"]

# vLLM's draft_sample_method values (vllm/config/speculative.py L85 ``DraftSampleMethod = Literal["greedy",
# "probabilistic"]``, default "greedy" L600; vllm 0.32.0): how the drafter draws; "greedy" (its argmax) is
# verified by the one-hot rule (onehot_chain.py), "probabilistic" by the rejection sampler (vllm_chain.py).
# The --draft-sampling values of scorer eval / compare / online.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")

# vLLM's rejection_sample_method values the scorer replays (vllm/config/speculative.py:84, default "standard"
# L529): "block" is block verification (block_verify.py); "synthetic" accepts with configured rates whatever
# the drafts (benchmarking only) and is not a rule a drafter is scored under. --rejection-sample-method.
REJECTION_SAMPLE_METHODS = ("standard", "block")
