"""``hscache extract --engine vllm``: generation and capture in vLLM, as served.

Two passes per batch of records, both in one in-process engine:

1. generation: vLLM's own sampler draws each continuation, with the stop tokens transformers would
   use, so a greedy fp32 run gives the transformers engine's text. A sampled setting (the cache's
   ``SamplingSetting``) is one request per (record, sample) with vLLM's own parameter names and a
   per-request seed (requests.py ``request_seed``, the judge's rule), ``logprobs`` = the support width
   + 1 under ``logprobs_mode`` processed_logprobs: the distribution each token was drawn from, masked
   tokens at -inf, becomes the cache's sampled arrays as a server's does with ``--responses-from``.
   The method is a speculative one (its proposer drafts the token just sampled,
   vllm/v1/spec_decode/extract_hidden_states.py:88-106), so decode steps go through the rejection
   sampler (temperature, top-k, top-p, penalties: vllm/v1/sample/rejection_sampler.py:522-578), whose
   per-token temperature and top-k need the CPU fix of cpu_patch.py, applied here; vLLM refuses min_p
   with speculative decoding (vllm/sampling_params.py:1189), and so does capture/preflight.py;
2. capture: prompt + continuation as the prompt (one prefill, so every position is computed the
   way a teacher-forced forward computes it, never by incremental decode), ``max_tokens=1``:
   the ``extract_hidden_states`` method caches the requested layers, the connector
   (connector.py) writes them when the request ends, and ``prompt_logprobs`` gives the target's
   next-token data at every position (the one generated token's ``logprobs`` the last row's).

vLLM returns log-probabilities (``logprobs_mode`` raw_logprobs: the fp32 log-softmax of the raw
logits, vllm/v1/worker/gpu_model_runner.py:5382-5390), not logits: the cache stores them as
``target_topk_values`` with ``target_logsumexp`` 0, so every top-k probability is exact
(``exp(value - lse)``) while the logits' own offset is not known (provenance says so).

Layer ids: hscache layer i = vLLM aux id i + 1 (files.py), so ``--layers`` means the same layers
for both engines. Prefix caching is off: a cached prefix would be served from pass 1's decode.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hscache.capture.forward import CapturedSequence
from hscache.capture.responses import ServedChoice, parse_choice
from hscache.engines.vllm import cpu_patch
from hscache.engines.vllm.files import read_connector_file, vllm_ids
from hscache.engines.vllm.outputs import completion_choice
from hscache.engines.vllm.requests import SEED_RULE, returned, sampling_fields, sampling_params
from hscache.engines.vllm.runtime import engine_env, engine_kwargs, require_vllm, start_engine, vision_stub
from hscache.store.sampling import GREEDY, SamplingSetting

__all__ = ["LOGITS_NOTE", "VllmCapture", "model_directory"]

LOGITS_NOTE = (
    "target_topk_values are vLLM's log-probabilities (raw_logprobs: logits minus their full-vocabulary "
    "log-sum-exp, fp32) and target_logsumexp is 0: top-k probabilities are exact, the logits' offset is not stored"
)
CONNECTOR_NAME = "HostHiddenStatesConnector"  # connector.py (imported by vLLM itself, by module path)
CONNECTOR_MODULE = "hscache.engines.vllm.connector"
_FLUSH_STEPS = 50  # engine steps to wait for the connector's files (one is enough in-process)


def model_directory(name: str, weights_sha256: str) -> Path:
    """A directory vLLM can load for ``name``: itself, or a built-in target saved once (``save_builtin``)
    under ``~/.cache/hscache/builtin/`` keyed by its weights' sha256."""
    if not name.startswith("builtin:"):
        return Path(name)
    from hscache.capture.builtin import save_builtin

    root = Path(os.environ.get("HSCACHE_BUILTIN_DIR", Path.home() / ".cache" / "hscache" / "builtin"))
    directory = root / f"{name.split(':', 1)[1]}-{weights_sha256[:16]}"
    if (directory / "config.json").is_file():
        return directory
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    # config, tokenizer, weights (its own draft head's included), as vLLM loads them
    save_builtin(name, staging)
    try:
        staging.rename(directory)  # whole or not at all; a concurrent writer's copy is as good
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


class VllmCapture:
    """An in-process vLLM engine that extracts ``layer_ids`` (hscache ids) with ``top_k`` logprobs.

    Use as a context manager: the engine and a temporary folder for the connector's files live
    inside it.
    """

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        layer_ids: Sequence[int],
        top_k: int,
        max_length: int,
        eos_ids: set[int],
        seed: int = 0,
        keep_files: Path | None = None,
        sampling: SamplingSetting = GREEDY,
    ):
        self.model_dir, self.dtype, self.layer_ids = Path(model_dir), dtype, list(layer_ids)
        self.top_k, self.max_length, self.eos_ids, self.seed = top_k, max_length, sorted(eos_ids), seed
        self.keep_files = keep_files  # where the capture pass's files go (hs_<n>.safetensors), else deleted
        self.sampling = sampling  # the generation pass's setting (a sampled one: drawn by vLLM's sampler)
        self.llm: Any = None
        self.version = ""
        self.patches: list[str] = []
        self.seconds_engine = 0.0

    def __enter__(self) -> VllmCapture:
        os.environ.update(engine_env())  # before vLLM is imported: it reads some of them at import
        vision_stub()
        self.version = require_vllm()
        # T > 0: the extract_hidden_states method verifies every decode step's "draft" with the rejection
        # sampler, whose expand_batch_to_tokens needs the CPU fix (cpu_patch.py); harmless when greedy.
        self.patches = cpu_patch.apply(self.version)
        self._files = Path(tempfile.mkdtemp(prefix="hscache-vllm-"))
        t0 = time.perf_counter()
        # One position past --max-length: the capture pass decodes one token after the longest sequence.
        self.max_length = min(self.max_length, _positions(self.model_dir) - 1)
        layers = {"eagle_aux_hidden_state_layer_ids": vllm_ids(self.layer_ids)}
        kwargs = engine_kwargs(
            str(self.model_dir),
            dtype=self.dtype,
            max_model_len=self.max_length + 1,
            seed=self.seed,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": layers},
            },
            max_logprobs=max(self.top_k, self.sampling.support_width + 1),
            hybrid=True,  # prefix caching off: a cached prefix would be served from pass 1's decode
        )
        kwargs.update(
            enable_chunked_prefill=False,  # docs/features/speculative_decoding/extract_hidden_states.md
            generation_config="vllm",  # greedy means argmax: not the model's shipped sampling defaults
            kv_transfer_config={
                "kv_connector": CONNECTOR_NAME,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self._files)},
            },
        )
        self.llm = start_engine(kwargs)
        self.seconds_engine = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.llm = None
        shutil.rmtree(self._files, ignore_errors=True)

    def kernels(self) -> dict[str, str]:
        """Which backend vLLM chose per layer kind (e.g. ``{"Attention": "CPU_ATTN", ...}``)."""
        core = self.llm.llm_engine.engine_core
        worker = getattr(core, "engine_core", core).model_executor.driver_worker
        model = getattr(worker, "worker", worker).model_runner.get_model()
        chosen: dict[str, str] = {}
        for module in model.modules():
            backend = getattr(module, "attn_backend", None)
            if backend is None and callable(getattr(module, "get_attn_backend", None)):
                backend = module.get_attn_backend()
            if backend is not None and type(module).__name__ not in chosen:
                name = backend.get_name() if hasattr(backend, "get_name") else backend.__name__
                chosen[type(module).__name__] = f"{name} ({backend.__module__}.{backend.__name__})"
        return chosen

    def kernel_bindings(self) -> dict[str, Any]:
        """``kernels()`` as the provenance's kernel records (backend name, implementing class)."""
        from hscache.capture.backend import KernelBinding

        return {
            kind: KernelBinding(kind, text.split(" ", 1)[0], text.split("(", 1)[1].rstrip(")"))
            for kind, text in self.kernels().items()
        }

    def describe(self) -> dict[str, Any]:
        """The provenance's ``capture.engine`` record."""
        return {
            "name": "vllm",
            "version": self.version,
            "layer_ids": vllm_ids(self.layer_ids),
            "logits": LOGITS_NOTE,
            "patches": list(self.patches),
        }

    def sampler(self) -> dict[str, Any]:
        """The provenance's ``sampling.sampler`` record of a setting vLLM drew: its engine, version, the
        per-request seed rule and the patches applied."""
        return {
            "engine": "vllm",
            "version": self.version,
            "seed_rule": SEED_RULE,
            "patches": list(self.patches),
        }

    def continuations(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[tuple[list[int], str]]:
        """Prompt + continuation per prompt and why it stopped ("eos", "max_new_tokens", "max_length",
        "none"), as ``hscache.capture.forward.continuations`` reports it (greedy)."""
        greedy = {"temperature": 0.0}
        return [(ids, reason) for ids, reason, _ in self._generate(prompts, max_new_tokens, greedy, None)]

    def sampled_continuations(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_new_tokens: int,
        vocab_size: int,
        names: Sequence[str] | None = None,
    ) -> list[tuple[list[int], str, ServedChoice]]:
        """As ``continuations``, drawn by vLLM's sampler at the engine's sampling setting, request i with
        seed ``seeds[i]``; each with its completion as a ``ServedChoice``: vLLM's processed distribution
        (``logprobs_mode`` processed_logprobs) at every generated position, read as ``--responses-from``
        reads a server's (capture/responses.py ``parse_choice``). ``names``: how a refusal names each.

        Raises:
            PromptFileError: a position whose returned logprobs do not hold its whole support (more tokens
                tie at the top-k boundary than ``support_width``).
        """
        fields = sampling_fields(self.sampling, vocab_size, max_new_tokens)
        done = self._generate(prompts, max_new_tokens, fields, list(seeds))
        width = self.sampling.support_width
        out = []
        for i, (ids, reason, request) in enumerate(done):
            if request is None:  # nothing generated (the prompt fills --max-length)
                choice = ServedChoice((), reason, (), (), width)
            else:
                where = f"{names[i] if names else f'prompt {i}'} (vLLM request seed {seeds[i]})"
                choice = parse_choice(where, completion_choice(0, request), width)
                choice = replace(choice, stop_reason=reason)
            out.append((ids, reason, choice))
        return out

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        fields: dict[str, Any],
        seeds: list[int] | None,
    ) -> list[tuple[list[int], str, dict[str, Any] | None]]:
        """Generation pass: (prompt + output, stop reason, the request as the judge's worker reports it:
        token ids, finish reason, per-position logprobs; None where nothing was generated)."""
        budgets = [min(max_new_tokens, self.max_length - len(p)) for p in prompts]
        results: list[tuple[list[int], str, dict[str, Any] | None] | None] = [None] * len(prompts)
        todo = [i for i, b in enumerate(budgets) if max_new_tokens > 0 and b > 0]
        for i in range(len(prompts)):
            if i not in todo:
                results[i] = (list(prompts[i]), "none" if max_new_tokens <= 0 else "max_length", None)
        params = [
            sampling_params(
                fields,
                None if seeds is None else seeds[i],
                max_tokens=budgets[i],
                stop_token_ids=self.eos_ids,
            )
            for i in todo
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(prompts[i])} for i in todo], params, use_tqdm=False
        )
        for path in self._flush(outputs):  # this pass's states are not the teacher-forced ones: dropped
            _remove(path)
        for i, out in zip(todo, outputs):
            request = returned(out.outputs[0])
            tokens = request["token_ids"]
            if tokens and tokens[-1] in self.eos_ids:
                reason = "eos"
            else:
                reason = "max_length" if budgets[i] < max_new_tokens else "max_new_tokens"
            results[i] = (list(prompts[i]) + tokens, reason, request)
        return [r for r in results if r is not None]

    def capture(
        self, sequences: Sequence[Sequence[int]], vocab_size: int, first: int = 0
    ) -> list[CapturedSequence]:
        """One prefill per sequence: its states at ``layer_ids`` and the next-token top-k at every row.
        ``first``: the number of the first sequence (``keep_files`` names them by it)."""
        from vllm import SamplingParams

        k = self.top_k
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False
        )
        paths = self._flush(outputs)
        captured = []
        for n, (seq, out, path) in enumerate(zip(sequences, outputs, paths), start=first):
            read = read_connector_file(path, len(self.layer_ids), vocab_size)
            if self.keep_files is not None:
                self.keep_files.mkdir(parents=True, exist_ok=True)
                path.replace(self.keep_files / f"hs_{n}.safetensors")
            _remove(path)
            if read.token_ids.tolist() != list(seq):
                raise RuntimeError(f"vLLM wrote the states of other tokens to {path}; this is a bug")
            rows = [*out.prompt_logprobs[1:], out.outputs[0].logprobs[0]]  # row t: the token after t
            ids, values = _topk_rows(rows, k)
            captured.append(
                CapturedSequence(
                    read.token_ids,
                    read.hidden_states,
                    ids[:, 0].clone(),
                    values,
                    ids,
                    torch.zeros(len(seq), dtype=torch.float32),
                    None,  # no [T, V] logits (--full-logits is refused with this engine)
                )
            )
        return captured

    def _flush(self, outputs: Sequence[Any]) -> list[Path]:
        """Step the engine until the connector has written every request's file; their paths.

        In-process, ``generate`` returns before the connector's save step runs: the finished
        requests reach it in the next engine step (``build_connector_meta`` -> ``get_finished``).
        """
        paths = [Path(o.kv_transfer_params["hidden_states_path"]) for o in outputs]
        for _ in range(_FLUSH_STEPS):
            if all(p.is_file() for p in paths):
                return paths
            self.llm.llm_engine.step()
        missing = [p for p in paths if not p.is_file()]
        raise RuntimeError(f"vLLM's connector wrote no file for {len(missing)} requests ({missing[0]})")


def _positions(model_dir: Path) -> int:
    """The target's ``max_position_embeddings`` (vLLM refuses a longer ``max_model_len``)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return int((config.get("text_config") or config).get("max_position_embeddings") or 1 << 30)


def _remove(path: Path) -> None:
    for p in (path, Path(str(path) + ".lock")):
        p.unlink(missing_ok=True)


def _topk_rows(rows: Sequence[dict], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k]`` ids and log-probabilities, sorted descending, from vLLM's per-position dicts (each
    holds the top-k and, when outside them, the actual next token with its rank: dropped here)."""
    ids = torch.empty((len(rows), k), dtype=torch.int64)
    values = torch.empty((len(rows), k), dtype=torch.float32)
    for t, row in enumerate(rows):
        ranked = sorted(row.items(), key=lambda item: (item[1].rank, item[0]))[:k]
        ids[t] = torch.tensor([token for token, _ in ranked])
        values[t] = torch.tensor([lp.logprob for _, lp in ranked])
    return ids, values
