"""What is built on the offline replay: ``evaluate`` (``scorer eval``: one drafter on one cache, or
many), ``compare`` (several drafters on one cache), ``compare_settings`` (one or more drafters across
caches of different sampling settings), ``sweep`` (every checkpoint of a training run), ``distributed``
(a cache's rows scored over a Dask cluster) and ``tau_as_served`` (tau as an engine serves it, from a
sampled cache). A study may import scorer/offline/ and scorer/online/; neither imports a study.
"""
