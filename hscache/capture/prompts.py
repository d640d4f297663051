"""Read prompt records from JSONL, one at a time, and turn each into prompt token ids.

A record is ``{"id", "prompt"}``, ``{"id", "messages"}`` (chat template applied when the
tokenizer has one) or ``{"id", "input_ids"}``; any other key is kept as metadata.
The file is streamed: memory does not grow with its size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from hscache.errors import PromptFileError

__all__ = [
    "DEFAULT_PROMPTS",
    "PromptRecord",
    "iter_records",
    "prompt_token_ids",
    "resolve_prompts",
    "response_token_ids",
]

DEFAULT_PROMPTS = "builtin:default"
_CONTENT_KEYS = ("prompt", "messages", "input_ids")
_RESPONSE_KEYS = ("response", "prompt_len")


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
    """The path of a prompts file; ``builtin:default`` is the bundled set of 20 prompts."""
    if str(prompts) == DEFAULT_PROMPTS:
        return Path(str(resources.files("hscache.data").joinpath("default_prompts.jsonl")))
    path = Path(prompts)
    if not path.is_file():
        raise PromptFileError(
            f"prompts file {str(path)!r} does not exist; pass a JSONL file or {DEFAULT_PROMPTS}"
        )
    return path


def _parse_line(path: Path, line_no: int, line: str) -> PromptRecord:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(
            f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    keys = [k for k in _CONTENT_KEYS if k in obj]
    if len(keys) != 1:
        raise PromptFileError(
            f"{where}: a record needs exactly one of 'prompt', 'messages', 'input_ids' (found {keys or 'none'})"
        )
    content = obj[keys[0]]
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
        isinstance(content, list) and content and all(isinstance(t, int) and t >= 0 for t in content)
    ):
        raise PromptFileError(f"{where}: 'input_ids' must be a non-empty list of non-negative integers")
    content, response = _split_response(where, keys[0], content, obj)
    record_id = str(obj.get("id", line_no))
    metadata = {k: v for k, v in obj.items() if k not in (*_CONTENT_KEYS, *_RESPONSE_KEYS, "id")}
    return PromptRecord(line_no, record_id, keys[0], content, metadata, response)


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


def iter_records(path: Path) -> Iterator[PromptRecord]:
    """Yield records in file order; blank lines are skipped.

    Raises:
        PromptFileError: a malformed line (with its line number) or a file with no records.
    """
    count = 0
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                count += 1
                yield _parse_line(path, line_no, line)
    if count == 0:
        raise PromptFileError(f"prompts file {str(path)!r} has no records; add one JSON object per line")


def prompt_token_ids(record: PromptRecord, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the record's prompt (chat template applied to ``messages`` when present)."""
    if record.content_key == "input_ids":
        ids = list(record.content)
        too_big = [t for t in ids if t >= len(tokenizer)]
        if too_big:
            raise PromptFileError(
                f"record {record.record_id!r} (line {record.line_no}): token id {too_big[0]} is outside "
                f"the tokenizer's vocabulary of {len(tokenizer)}"
            )
        return ids
    if record.content_key == "messages":
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(record.content, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return list(ids)
        text = "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in record.content)
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    return tokenizer(record.content, add_special_tokens=True)["input_ids"]


def response_token_ids(record: PromptRecord, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the record's dataset continuation (empty when it has none)."""
    if record.response is None:
        return []
    if record.content_key == "input_ids":
        return list(record.response)
    return tokenizer(record.response, add_special_tokens=False)["input_ids"]
