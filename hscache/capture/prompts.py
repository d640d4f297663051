"""Read prompt records from JSONL, one at a time, and turn each into prompt token ids.

A record is ``{"id", "prompt"}``, ``{"id", "messages"}`` (chat template applied when the
tokenizer has one; ShareGPT ``conversations`` of ``{"from", "value"}`` are read as messages) or
``{"id", "input_ids"}``; any other key is kept as metadata. Chat data whose last turn is the
assistant's carries its answer: that turn is the response (see ``response_token_ids``).
The file is streamed: memory does not grow with its size.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hscache.capture.prompt_sets import DEFAULT_PROMPTS, PROMPT_SETS, prompt_set_path
from hscache.errors import PromptFileError
from hscache.store import jsonio

if TYPE_CHECKING:  # transformers is imported only where a tokenizer is really used (CLI start-up)
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_PROMPTS",
    "assistant_turn",
    "cache_records",
    "cache_records_sha256",
    "first_records",
    "PromptRecord",
    "iter_records",
    "prompt_token_ids",
    "resolve_prompts",
    "response_token_ids",
    "unique_ids",
]

_CONTENT_KEYS = ("prompt", "messages", "conversations", "input_ids")
# ShareGPT speaker names (SpecForge / speculators data) -> chat roles.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
_RESPONSE_KEYS = ("response", "prompt_len")
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class PromptRecord:
    line_no: int  # 1-based line in the prompts file, for error messages
    record_id: str
    content_key: str  # which of _CONTENT_KEYS carried the content
    content: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    # Dataset text after the prompt: a "response" string, or input_ids past "prompt_len".
    # Cached as is (with --max-new-tokens 0), so scoring starts where the prompt ends.
    response: Any = None


def resolve_prompts(prompts: str | Path) -> Path:
    """The path of a prompts file; a bundled set's name (``builtin:default``, the 20 built-in
    prompts; ``humaneval``; ``mt-bench``: see capture/prompt_sets.py) names its bundled file."""
    bundled = prompt_set_path(str(prompts))
    if bundled is not None:
        return bundled
    path = Path(prompts)
    if not path.is_file():
        raise PromptFileError(
            f"prompts file {str(path)!r} does not exist; pass a JSONL file or a bundled set: "
            + ", ".join(PROMPT_SETS)
        )
    return path


def _parse_line(path: Path, line_no: int, line: str, id_from_line: bool = False) -> PromptRecord:
    where = f"{path}:{line_no}"
    try:
        obj = jsonio.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if (bad := jsonio.first_surrogate(obj)) is not None:
        raise PromptFileError(
            f"{where}: the string {bad!r} holds a lone surrogate (an escape such as \\ud800 that is not "
            "text), which cannot be stored; fix the line"
        )
    keys = [k for k in _CONTENT_KEYS if k in obj]
    if len(keys) != 1:
        raise PromptFileError(
            f"{where}: a record needs exactly one of 'prompt', 'messages', 'conversations', 'input_ids' "
            f"(found {keys or 'none'})"
        )
    content = obj[keys[0]]
    if keys[0] == "conversations":
        content, keys = _sharegpt_messages(where, content), ["messages"]
    if keys[0] == "prompt" and not (isinstance(content, str) and content):
        raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
    if keys[0] == "messages" and not (
        isinstance(content, list)
        and content
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in content
        )
    ):
        raise PromptFileError(
            f'{where}: \'messages\' must be a non-empty list of {{"role": str, "content": str}} objects'
        )
    if keys[0] == "input_ids" and not (
        isinstance(content, list) and content and all(type(t) is int and t >= 0 for t in content)
    ):
        raise PromptFileError(f"{where}: 'input_ids' must be a non-empty list of non-negative integers")
    content, response = _split_response(where, keys[0], content, obj)
    if keys[0] == "messages" and len(content) > 1 and content[-1]["role"] == "assistant":
        if "response" in obj or "prompt_len" in obj:
            raise PromptFileError(
                f"{where}: 'messages' ending in an assistant turn already carries its response; "
                "drop 'response'/'prompt_len'"
            )
        # The last assistant turn is the dataset's answer: cached as is with --max-new-tokens 0.
        content, response = content[:-1], content[-1]
    if "id" not in obj and not id_from_line:
        # A silent line-number id breaks as soon as the file is edited or filtered (resume, diff).
        raise PromptFileError(
            f"{where}: the record has no 'id'; give every record a unique \"id\", or pass "
            "--id-from-line to number records by their line"
        )
    record_id = str(obj.get("id", line_no))
    metadata = {k: v for k, v in obj.items() if k not in (*_CONTENT_KEYS, *_RESPONSE_KEYS, "id")}
    return PromptRecord(line_no, record_id, keys[0], content, metadata, response)


def _sharegpt_messages(where: str, turns: Any) -> list[dict[str, str]]:
    """ShareGPT ``[{"from": "human"|"gpt"|..., "value": str}]`` as chat ``messages``."""
    ok = (
        isinstance(turns, list)
        and turns
        and all(
            isinstance(t, dict) and t.get("from") in _SHAREGPT_ROLES and isinstance(t.get("value"), str)
            for t in turns
        )
    )
    if not ok:
        raise PromptFileError(
            f"{where}: 'conversations' must be a non-empty list of {{\"from\": human|gpt|system|tool, "
            '"value": str} objects (ShareGPT)'
        )
    return [{"role": _SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def _split_response(where: str, key: str, content: Any, obj: dict[str, Any]) -> tuple[Any, Any]:
    """(prompt content, response) from a record's optional "response" / "prompt_len"."""
    if "response" in obj:
        if key != "prompt" or not isinstance(obj["response"], str):
            raise PromptFileError(
                f"{where}: 'response' must be a string next to 'prompt'; "
                "for token ids use 'input_ids' with 'prompt_len'"
            )
        return content, obj["response"]
    if "prompt_len" in obj:
        prompt_len = obj["prompt_len"]
        if key != "input_ids" or not (isinstance(prompt_len, int) and 1 <= prompt_len <= len(content)):
            raise PromptFileError(
                f"{where}: 'prompt_len' must be an integer in 1..len(input_ids) next to "
                f"'input_ids' (got {prompt_len!r})"
            )
        return content[:prompt_len], content[prompt_len:]
    return content, None


def _decoded(path: Path, line_no: int, raw: bytes) -> str:
    if line_no == 1 and raw.startswith(_UTF8_BOM):  # editors on Windows write one; it is not data
        raw = raw[len(_UTF8_BOM) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(
            f"{path}:{line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "save the prompts file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def iter_records(path: Path, *, id_from_line: bool = False) -> Iterator[PromptRecord]:
    """Yield records in file order; blank lines are skipped; a leading UTF-8 BOM is ignored.

    ``id_from_line``: a record without ``"id"`` takes its line number (otherwise it is refused).

    Raises:
        PromptFileError: a malformed or non-UTF-8 line (with its line number), a record without
            an id, or a file with no records.
    """
    count = 0
    with path.open("rb") as f:  # bytes: a decoding error is then reported with its line number
        for line_no, raw in enumerate(f, start=1):
            line = _decoded(path, line_no, raw)
            if line.strip():
                count += 1
                yield _parse_line(path, line_no, line, id_from_line)
    if count == 0:
        raise PromptFileError(f"prompts file {str(path)!r} has no records; add one JSON object per line")


def first_records(records: Iterator[PromptRecord], limit: int | None) -> Iterator[PromptRecord]:
    """The first ``limit`` of ``records`` (all when None), read no further than that."""
    for n, record in enumerate(records):
        if limit is not None and n >= limit:
            return
        yield record


def unique_ids(records: Iterator[PromptRecord], suffix: bool) -> Iterator[PromptRecord]:
    """Refuse a record id seen before (scores and diffs pair sequences by id), or suffix it."""
    seen: dict[str, int] = {}
    for record in records:
        if record.record_id in seen:
            if not suffix:
                raise PromptFileError(
                    f"record id {record.record_id!r} (line {record.line_no}) is used before, on line "
                    f"{seen[record.record_id]}; give every record its own id, or pass --suffix-duplicate-ids"
                )
            n = 2
            while f"{record.record_id}#{n}" in seen:
                n += 1
            record = replace(record, record_id=f"{record.record_id}#{n}")
        seen[record.record_id] = record.line_no
        yield record


def assistant_turn(record: PromptRecord) -> str | None:
    """A chat record's final assistant turn (its dataset answer, ``record.response``) shortened for a
    message, or None when the record carries none."""
    if record.content_key != "messages" or not isinstance(record.response, dict):
        return None
    text = str(record.response.get("content", ""))
    return repr(text if len(text) <= 40 else text[:37] + "...")


def prompt_token_ids(
    record: PromptRecord, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None
) -> list[int]:
    """Token ids of the record's prompt (chat template applied to ``messages`` when present).

    ``vocab_size``: the target's embedding rows, which ``input_ids`` must stay below (a model may
    have more rows than its tokenizer has entries, and generate those ids; default: the tokenizer's).
    """
    if record.content_key == "input_ids":
        ids = list(record.content)
        _check_ids(record, ids + list(record.response or []), tokenizer, vocab_size)
        return ids
    if record.content_key == "messages":
        if isinstance(record.response, dict):
            full, prompt = _chat_ids(record, tokenizer)
            ids = full[: len(prompt)]
        else:
            ids = _chat_prompt_ids(record.content, tokenizer)
    else:
        ids = tokenizer(record.content, add_special_tokens=True)["input_ids"]
    if not ids:  # was: transformers' IndexError deep in generate()
        raise PromptFileError(
            f"record {record.record_id!r} (line {record.line_no}): the --model tokenizer gives no token ids "
            "for its prompt (it drops every character and adds no BOS), so there is nothing to condition "
            "on: give the record text the tokenizer knows, or its input_ids"
        )
    return ids


def response_token_ids(record: PromptRecord, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the record's dataset continuation (empty when it has none).

    For chat data it is the last assistant turn as the chat template renders it (with its end of
    turn), while the prompt ends with the template's own assistant header.
    """
    if record.response is None:
        return []
    if record.content_key == "input_ids":
        return list(record.response)
    if isinstance(record.response, dict):
        full, prompt = _chat_ids(record, tokenizer)
        return full[len(prompt) :]
    return tokenizer(record.response, add_special_tokens=False)["input_ids"]


def _check_ids(
    record: PromptRecord, ids: list[int], tokenizer: PreTrainedTokenizerBase, vocab_size: int | None
) -> None:
    limit = vocab_size if vocab_size is not None else len(tokenizer)
    too_big = [t for t in ids if t >= limit]
    if too_big:
        what = "the model's" if vocab_size is not None else "the tokenizer's"
        raise PromptFileError(
            f"record {record.record_id!r} (line {record.line_no}): token id {too_big[0]} is outside "
            f"{what} vocabulary of {limit}"
        )


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)


def _chat_prompt_ids(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return tokenizer(_plain_chat(messages), add_special_tokens=True)["input_ids"]


def _plain_chat(messages: list[dict[str, str]]) -> str:
    """Chat as text for a tokenizer without a chat template."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _chat_ids(record: PromptRecord, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """(whole conversation, prompt up to and with the assistant header), tokenized as the model
    would see the conversation; the prompt must be a prefix of the whole."""
    messages = [*record.content, record.response]
    if getattr(tokenizer, "chat_template", None):
        full = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))
    else:
        # No template: the prompt ends with the assistant's name, as a template's header would.
        text = _plain_chat([*record.content, {"role": "assistant", "content": ""}])
        prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
        full = tokenizer(text + record.response["content"], add_special_tokens=True)["input_ids"]
        return _checked_prefix(record, full, prompt)
    prompt = _chat_prompt_ids(record.content, tokenizer)
    return _checked_prefix(record, full, prompt)


def _checked_prefix(record: PromptRecord, full: list[int], prompt: list[int]) -> tuple[list[int], list[int]]:
    if full[: len(prompt)] != prompt:
        raise PromptFileError(
            f"record {record.record_id!r} (line {record.line_no}): the chat template does not render the "
            "conversation as its prompt (with the assistant header) followed by the last assistant turn; "
            "pass 'input_ids' with 'prompt_len' instead"
        )
    return full, prompt


def cache_records(cache_path: str | Path) -> Iterator[PromptRecord]:
    """Another cache's sequences as records: its token ids split at its prompt_len, with its record
    ids and metadata (``extract --tokens-from``: two caches on identical tokens, e.g. two kernels).

    Raises:
        CacheNotFoundError / CacheFormatError: ``cache_path`` is not a readable cache.
        PromptFileError: it holds no sequences.
    """
    from hscache.store.open import open_cache

    cache = open_cache(cache_path)
    if len(cache) == 0:
        raise PromptFileError(f"--tokens-from {cache_path} holds no committed sequences")
    index = cache.index
    for row, (record_id, prompt_len, metadata) in enumerate(
        zip(
            index.column("record_id").to_pylist(),
            index.column("prompt_len").to_pylist(),
            index.column("metadata_json").to_pylist(),
        )
    ):
        ids = cache.token_ids(row).tolist()
        # A prompt of the whole sequence (prompt_len == length) is replayed as a prompt alone.
        cut = max(1, int(prompt_len))
        yield PromptRecord(
            row + 1,
            record_id,
            "input_ids",
            ids[:cut],
            json.loads(metadata) if metadata else {},
            ids[cut:] or None,
        )


def cache_records_sha256(cache_path: str | Path) -> str:
    """What identifies ``cache_records``: every record id, prompt_len and token hash, in order."""
    from hscache.store.open import open_cache

    index = open_cache(cache_path).index
    digest = hashlib.sha256()
    for values in zip(*(index.column(c).to_pylist() for c in ("record_id", "prompt_len", "token_sha256"))):
        digest.update(json.dumps(values).encode())
    return digest.hexdigest()
