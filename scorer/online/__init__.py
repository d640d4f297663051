"""The target in the loop: real speculative decoding, the target verifying every round.

``greedy`` decodes at temperature 0 (``scorer online``); ``sampled`` at temperature > 0, verifying
with the engines' rules of scorer/rules/ over many seeded runs (``scorer online --runs N``). It never
imports the offline replay (scorer/offline/).
"""
