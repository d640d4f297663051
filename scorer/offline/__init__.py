"""The offline replay: scoring a drafter against cached rows, with no target in the loop.

``replay`` is the speculative-decoding round loop over one cached sequence (and the greedy chain
match it counts); ``sequences`` the per-row loop every family scores through; ``scoring`` loading a
drafter and dispatching a cache's rows to its family; ``sampled_view`` the view of a cache extracted at
temperature > 0 (the one-hot and probabilistic rules chosen from it); ``sampled_tau`` tau as served from
a sampled cache's rounds. It calls the rules of scorer/rules/ and never imports scorer/online/.
"""
