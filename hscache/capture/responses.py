"""``hscache extract --responses-from FILE``: completions a server sampled, teacher-forced by the target.

The file is JSON lines, one prompt each (docs/extract.md "Trajectories a server produced" gives the
server flags and request fields that produce it)::

    {"id": "r1", "request": {...the JSON body sent...}, "response": {...the JSON the server returned...},
     ...any other key is metadata}

``response`` is an OpenAI-compatible ``/v1/completions`` or ``/v1/chat/completions`` answer with token
ids and top logprobs, as vLLM returns them (vllm/entrypoints/openai/completion/protocol.py
``CompletionLogProbs``/``CompletionResponseChoice`` and chat_completion/protocol.py
``ChatCompletionLogProbsContent``, commit d5dba2d7): tokens named ``token_id:N``
(``return_tokens_as_token_ids``), the prompt's ids in ``prompt_token_ids`` (``return_token_ids``) or
the request's ``prompt`` given as ids, the completion's in ``token_ids``. Each choice is one sample.
The returned logprobs are kept as the processed distribution p (vLLM ``--logprobs-mode
processed_logprobs``): a position's support is its entries above vLLM's -9999 floor, and it must be
complete (an entry at the floor is returned, or the entries hold all but 1e-4 of the mass),
otherwise the record is refused by name. Every logprob must be a finite number (NaN, infinities,
strings and booleans are refused, never read as "at the floor"), and a support must be a
distribution: its probabilities sum to 1 within ``MASS_TOLERANCE`` (1e-4). Token ids are
``token_id:N`` with N at most 10 ASCII digits (the model's vocabulary is checked once it is
loaded, before it runs), and no string of a line may hold a lone surrogate. Pure Python: read
before torch is imported, and every line is checked before the target is loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from hscache.capture.prompts import PromptRecord
from hscache.errors import PromptFileError
from hscache.store import jsonio
from hscache.store.sampling import SAMPLING_PARAMETERS, SamplingSetting

__all__ = [
    "MASS_TOLERANCE",
    "ServedChoice",
    "ServedRecord",
    "expand_samples",
    "iter_responses",
    "parse_choice",
    "responses_sampling",
    "served_arrays",
    "with_choice",
]

# vLLM writes a masked (-inf) logprob as this floor (ChatCompletionLogProb.logprob default; serving code clamps to it).
_LOGPROB_FLOOR = -9999.0
# How far from 1 a position's processed probabilities may sum (float32 logprobs of a few hundred
# entries sum to 1 within ~1e-6).
MASS_TOLERANCE = 1e-4
_TOKEN_NAME = re.compile(r"token_id:(0|[1-9][0-9]{0,9})")
# Request fields -> setting fields, and vLLM's request defaults for those left out
# (vllm/entrypoints/openai/completion/protocol.py _DEFAULT_SAMPLING_PARAMS; top_k 0 = disabled).
_FIELDS = (*SAMPLING_PARAMETERS, "seed")
_REQUEST_DEFAULTS = dict(
    temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
    repetition_penalty=1.0, seed=None,
)  # fmt: skip
_FINISH = {"stop": "eos", "length": "max_new_tokens"}


@dataclass(frozen=True)
class ServedChoice:
    """One sampled completion: its ids, why it stopped, and per generated position the support."""

    token_ids: tuple[int, ...]
    stop_reason: str
    support: tuple[tuple[tuple[int, float], ...], ...]  # per position: (id, prob) sorted by prob, descending
    realised: tuple[float, ...]  # per position: the processed probability of the token drawn (0: outside)
    width: int  # the stored support entries per position (the setting's support_width)


@dataclass(frozen=True)
class ServedRecord(PromptRecord):
    """A prompt (``content``: its token ids) and the server's choices; expanded to one record per choice
    (``choice`` set, ``response`` its ids, ``metadata["sample"]`` its index) by ``expand_samples``."""

    choices: tuple[ServedChoice, ...] = ()
    choice: ServedChoice | None = None


def _where(path: Path, line_no: int, record_id: Any = None) -> str:
    return f"{path}:{line_no}" + (f" (record {record_id!r})" if record_id is not None else "")


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise PromptFileError(
            f"--responses-from {str(path)!r} cannot be read ({exc.strerror or exc}); pass a JSONL file"
        ) from None
    count = 0
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                obj = jsonio.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise PromptFileError(
                    f"{path}:{line_no}: not a UTF-8 JSON object ({exc}); one server answer per line"
                ) from None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("request"), dict)
                or not isinstance(obj.get("response"), dict)
            ):
                raise PromptFileError(
                    f'{path}:{line_no}: expected {{"id", "request": {{...}}, "response": {{...}}}}'
                )
            if (bad := jsonio.first_surrogate(obj)) is not None:
                raise PromptFileError(
                    f"{path}:{line_no}: the string {bad!r} holds a lone surrogate (an escape such as \\ud800 "
                    "that is not text), which cannot be stored; fix the line"
                )
            count += 1
            yield line_no, obj
    if count == 0:
        raise PromptFileError(
            f"--responses-from {str(path)!r} holds no responses; write one JSON object per line"
        )


def _request_setting(request: dict[str, Any], choices: int) -> dict[str, Any]:
    values = {k: request[k] for k in _FIELDS if request.get(k) is not None}
    if values.get("top_k") == 0:
        values["top_k"] = -1  # vLLM reads 0 as disabled too
    return {**values, "samples_per_prompt": choices}


def responses_sampling(path: str | Path, flags: dict[str, Any] | None = None) -> SamplingSetting:
    """The sampling setting of a responses file: its requests' fields (every line must agree),
    flags for the fields the requests leave out, else vLLM's request defaults.

    Raises:
        PromptFileError: unreadable file, lines that disagree, a flag that contradicts the file.
        InputError: the resulting setting is out of range or greedy.
    """
    path, flags = Path(path), {k: v for k, v in (flags or {}).items() if v is not None}
    first: dict[str, Any] | None = None
    for line_no, obj in _lines(path):
        choices = obj["response"].get("choices")
        values = _request_setting(obj["request"], len(choices) if isinstance(choices, list) else 0)
        if first is None:
            first = values
        elif values != first:
            key = next(k for k in {*values, *first} if values.get(k) != first.get(k))
            raise PromptFileError(
                f"{_where(path, line_no, obj.get('id'))}: its request has {key} {values.get(key)} but the first "
                f"line's has {first.get(key)}; one cache holds one sampling setting: split the file"
            )
    assert first is not None
    clash = [k for k, v in flags.items() if k in first and first[k] != v]
    if clash:
        raise PromptFileError(
            f"--{clash[0].replace('_', '-')} {flags[clash[0]]} contradicts "
            f"{path}'s requests ({clash[0]} {first[clash[0]]}); drop the flag"
        )
    values = {**_REQUEST_DEFAULTS, **flags, **first}
    setting = SamplingSetting(**values, drawn_by="server")
    if setting.greedy:
        raise PromptFileError(
            f"{path}'s requests are greedy (temperature 0): --responses-from reads sampled completions; "
            "cache greedy text with --prompts (input_ids + prompt_len) and --max-new-tokens 0"
        )
    setting = setting.validate()
    for _ in iter_responses(path, setting):  # every line's logprobs, before the target is loaded
        pass
    return setting


def _token_id(where: str, name: Any) -> int:
    if isinstance(name, str) and _TOKEN_NAME.fullmatch(name):
        return int(name[9:])
    if isinstance(name, str) and name.startswith("token_id:"):
        raise PromptFileError(
            f"{where}: its logprobs name a token {name[:40]!r}, not token_id:N with N a token id of at most "
            "10 digits; fix the file"
        )
    raise PromptFileError(
        f"{where}: its logprobs name tokens as text ({str(name)[:40]!r}); request return_tokens_as_token_ids: true"
    )


def _positions(where: str, logprobs: Any) -> list[tuple[int, float | None, list[tuple[int, float | None]]]]:
    """(token id, its logprob, top entries) per generated position, from a completions or chat choice."""
    if not isinstance(logprobs, dict):
        raise PromptFileError(f"{where}: a choice has no logprobs; request logprobs (top_logprobs) >= top_k")
    if isinstance(logprobs.get("content"), list):  # chat completions
        return [
            (_token_id(where, c.get("token")), c.get("logprob"),
             [(_token_id(where, t.get("token")), t.get("logprob")) for t in c.get("top_logprobs") or []])
            for c in logprobs["content"]
        ]  # fmt: skip
    tokens, own, top = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not (
        isinstance(tokens, list)
        and isinstance(own, list)
        and isinstance(top, list)
        and len(tokens) == len(own) == len(top)
    ):
        raise PromptFileError(
            f"{where}: logprobs needs tokens, token_logprobs and top_logprobs of one length each"
        )
    return [
        (_token_id(where, t), lp, [(_token_id(where, k), v) for k, v in (entries or {}).items()])
        for t, lp, entries in zip(tokens, own, top)
    ]


def _finite(lp: Any) -> bool:
    return isinstance(lp, (int, float)) and math.isfinite(lp) and lp > _LOGPROB_FLOOR


def _checked_logprob(where: str, position: int, token: int, lp: Any) -> float:
    """``lp`` as a float: a finite number at most 0 (within the tolerance), else refused by name."""
    ok = isinstance(lp, (int, float)) and not isinstance(lp, bool) and math.isfinite(lp)
    if not ok or lp > math.log1p(MASS_TOLERANCE):
        what = f"{lp!r} ({type(lp).__name__})" if not isinstance(lp, float) else repr(lp)
        raise PromptFileError(
            f"{where}, generated position {position}: token {token} has logprob {what[:60]}, not a finite "
            f"number <= 0 (a masked token is returned at the {_LOGPROB_FLOOR:g} floor); the file is not a "
            "server's processed logprobs: re-request it"
        )
    return float(lp)


def _support(
    where: str, position: int, token: int, own: Any, entries: list, width: int
) -> tuple[tuple, float]:
    merged = {t: _checked_logprob(where, position, t, lp) for t, lp in entries}
    own = _checked_logprob(where, position, token, own)
    if token in merged and abs(merged[token] - own) > MASS_TOLERANCE:
        raise PromptFileError(
            f"{where}, generated position {position}: the drawn token {token} has logprob {own!r} but its top "
            f"entry says {merged[token]!r}; the file is not one server answer: re-request it"
        )
    merged.setdefault(token, own)
    kept = sorted(((t, math.exp(lp)) for t, lp in merged.items() if _finite(lp)), key=lambda e: (-e[1], e[0]))
    mass = sum(p for _, p in kept)
    if abs(mass - 1) > MASS_TOLERANCE and (len(kept) < len(merged) or mass > 1):
        raise PromptFileError(
            f"{where}, generated position {position}: its support's probabilities sum to {mass:.6g}, not 1 within "
            f"{MASS_TOLERANCE:g}; it is not a distribution: re-request it from a server run with "
            "--logprobs-mode processed_logprobs"
        )
    complete = len(kept) < len(merged) or mass >= 1 - MASS_TOLERANCE
    if not complete:
        raise PromptFileError(
            f"{where}, generated position {position}: its {len(merged)} logprobs hold {sum(p for _, p in kept):.4f} "
            "of the processed distribution, fewer tokens than its top-k support; request logprobs (chat: "
            "top_logprobs) > top_k from a server run with --logprobs-mode processed_logprobs"
        )
    if len(kept) > width:
        raise PromptFileError(
            f"{where}, generated position {position}: {len(kept)} tokens in the support, more than the {width} stored"
        )
    return tuple(kept), (math.exp(own) if _finite(own) else 0.0)


def parse_choice(where: str, choice: Any, width: int) -> ServedChoice:
    """One completions/chat choice (a dict as the server returned it) as a ``ServedChoice`` whose supports
    hold at most ``width`` entries; ``where`` names it in a refusal.

    Raises:
        PromptFileError: as ``iter_responses`` (logprobs missing, a support that is not complete ...).
    """
    if not isinstance(choice, dict):
        raise PromptFileError(f"{where}: a choice is not an object")
    positions = _positions(where, choice.get("logprobs"))
    ids = [t for t, _, _ in positions]
    if choice.get("token_ids") is not None and (
        not isinstance(choice["token_ids"], list) or list(choice["token_ids"]) != ids
    ):
        raise PromptFileError(f"{where}: a choice's token_ids differ from its logprobs' tokens")
    if not ids:
        raise PromptFileError(f"{where}: a choice has no generated tokens")
    support, realised = zip(*(_support(where, n, t, lp, e, width) for n, (t, lp, e) in enumerate(positions)))
    stop = _FINISH.get(choice.get("finish_reason"), "served")
    return ServedChoice(tuple(ids), stop, tuple(support), tuple(realised), width)


def _prompt_ids(where: str, request: dict[str, Any], response: dict[str, Any]) -> list[int]:
    candidates = [request.get("prompt"), response.get("prompt_token_ids")]
    candidates += [c.get("prompt_token_ids") for c in response.get("choices") or [] if isinstance(c, dict)]
    for ids in candidates:
        if isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids):
            return list(ids)
    raise PromptFileError(
        f"{where}: no prompt token ids; send the prompt as token ids or request return_token_ids: true"
    )


def iter_responses(path: str | Path, setting: SamplingSetting) -> Iterator[ServedRecord]:
    """Every line of a responses file as a ``ServedRecord``, in file order (streamed).

    Raises:
        PromptFileError: naming the line and record: no id, no prompt ids, logprobs missing, or a
            position whose logprobs do not cover its support.
    """
    path = Path(path)
    for line_no, obj in _lines(path):
        record_id = obj.get("id")
        if not isinstance(record_id, str) or not record_id:
            raise PromptFileError(f'{path}:{line_no}: every response needs an "id" (a non-empty string)')
        where = _where(path, line_no, record_id)
        request, response = obj["request"], obj["response"]
        choices = response.get("choices")
        if not isinstance(choices, list) or not choices:
            raise PromptFileError(f"{where}: the response has no choices")
        metadata = {k: v for k, v in obj.items() if k not in ("id", "request", "response")}
        yield ServedRecord(
            line_no,
            record_id,
            "input_ids",
            _prompt_ids(where, request, response),
            metadata,
            choices=tuple(parse_choice(where, c, setting.support_width) for c in choices),
        )


def expand_samples(records: Iterator[PromptRecord], setting: SamplingSetting) -> Iterator[PromptRecord]:
    """One record per sample: ``samples_per_prompt`` copies (a served record: one per choice), each with
    ``metadata["sample"]`` (0-based); the record id stays the prompt's. A greedy setting: as they are."""
    if setting.greedy:
        yield from records
        return
    for record in records:
        if "sample" in record.metadata:
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}) has a 'sample' key, which a sampled cache "
                "uses for the sample number; rename it"
            )
        if isinstance(record, ServedRecord):
            for n, choice in enumerate(record.choices):
                meta = {**record.metadata, "sample": n}
                yield replace(
                    record, metadata=meta, response=list(choice.token_ids), choices=(), choice=choice
                )
            continue
        for n in range(setting.samples_per_prompt):
            yield replace(record, metadata={**record.metadata, "sample": n})


def with_choice(record: PromptRecord, choice: ServedChoice) -> ServedRecord:
    """``record`` (one sample of a prompt) with the completion an engine drew for it: its sampled arrays
    are then the engine's distribution (``served_arrays``), as for a record read from a responses file."""
    values = {f.name: getattr(record, f.name) for f in fields(PromptRecord)}
    return ServedRecord(**{**values, "response": list(choice.token_ids)}, choice=choice)


def served_arrays(choice: ServedChoice, length: int, prompt_len: int) -> dict[str, np.ndarray]:
    """The stored sampled arrays of one served sequence (store/layout.py ``sampled_array_specs``)."""
    width = choice.width
    ids = np.full((length, width), -1, dtype=np.int32)
    probs = np.zeros((length, width), dtype=np.float32)
    realised = np.full((length,), np.nan, dtype=np.float32)
    for n, (support, p) in enumerate(zip(choice.support, choice.realised)):
        row = prompt_len - 1 + n
        ids[row, : len(support)] = [t for t, _ in support]
        probs[row, : len(support)] = [q for _, q in support]
        realised[row] = p
    return {"sampled_support_ids": ids, "sampled_support_probs": probs, "sampled_token_prob": realised}
