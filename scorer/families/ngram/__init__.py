"""vLLM's n-gram (prompt lookup) proposer as a drafter family (issue 24, family 5): no weights.

propose.py is the proposer (vLLM ``ngram_proposer.py``), replay.py its rounds on a cached
sequence through the shared round loop. The family entry (registration on the Family seam) is
wired in once scorer/families/base.py settles.
"""

__all__: list[str] = []
