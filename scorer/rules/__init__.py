"""Each serving engine's verification rule, as pure functions: drafts and the target's processed
distribution (or its sampled tokens) in, accepted counts out.

``vllm_chain`` transcribes vLLM's probabilistic chain round (rejection sampling, min(1, p/q), the
recovered-token draw; ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py`` and
``vllm/v1/sample/rejection_sampler.py``, vLLM v0.33.0); ``sglang_tree`` SGLang's target-only tree rule
(``sgl-kernel/csrc/speculative/speculative_sampling.cuh``, commit b227f632) and the z-lab reference
(``dflash/model.py``, snapshot 44947fbf); ``expectation`` the exact expectation (the DP) of the one-hot
and probabilistic rules over a sampled cache, and the one-hot acceptance. The offline replay
(scorer/offline/) and the online loop (scorer/online/) call these; nothing here imports a family, the
offline replay or the online loop (tests/test_architecture.py).
"""
