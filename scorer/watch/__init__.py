"""``scorer watch`` and the in-process training callbacks: tau on the training dashboard.

checkpoints.py finds the checkpoints the trainers write in a run folder (their layouts, their steps)
and says when one is complete; results.py keeps the append-only results log and its lock; record.py
turns an eval report into one logged record; sinks.py writes records to TensorBoard, W&B, trackio
or MLflow; run.py is the watch loop; callbacks.py scores inside a training loop (transformers'
Trainer, speculators' Trainer, a plain loop). The page is scorer/report/watch.py.

Nothing here is imported by ``import scorer``: the command and the callbacks import what they use.
"""
