"""The sampling setting a cache was extracted at: greedy, or a vLLM sampling configuration.

Pure Python (no torch): ``hscache extract`` validates its sampling flags with
``SamplingSetting.from_flags`` before anything heavy is imported, and every reader gets the
setting of a cache with ``sampling_setting(cache)`` / ``cache.sampling``.

A greedy cache records nothing (its digest stays what it was before sampling existed): a cache
whose settings have no ``sampling`` entry is greedy, temperature 0. A sampled cache records the
whole setting (``SamplingSetting.to_dict``) in its manifest's settings, so it is digested and a
resume must match it. Ranges follow vLLM's ``SamplingParams._verify_args``
(vllm/sampling_params.py, commit db573835); the processing order is vLLM's
(/work/shared/spec/sampling.md section 5; docs/extract.md "Sampled extraction").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from hscache.errors import InputError

__all__ = [
    "DEFAULT_SEED",
    "ENGINE",
    "GREEDY",
    "PRESETS",
    "PROCESSING_ORDER",
    "SAMPLING_EPS",
    "SAMPLING_PARAMETERS",
    "SamplingSetting",
    "generation_config_values",
    "sampling_setting",
]

# The processed distribution's parameters, vLLM's SamplingParams names (a request's fields, the
# setting's fields, the flags' names with '-' for '_'; top_k is --top-k on the command line, as in vLLM).
SAMPLING_PARAMETERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
ENGINE = "vllm"  # the engine convention the processor implements (recorded in every sampled cache)
PROCESSING_ORDER = (
    "repetition_penalty",  # prompt + generated tokens: positive logits / r, others * r
    "frequency_penalty",  # generated tokens: minus f * count
    "presence_penalty",  # generated tokens: minus p once
    "temperature",  # divide
    "min_p",  # drop probabilities below min_p * the largest
    "top_k",  # keep the values >= the k-th largest (ties kept)
    "top_p",  # drop the smallest while their cumulative probability <= 1 - top_p (keep one)
    "renormalise",
)
DEFAULT_SEED = 0  # a sampled extraction without --seed
SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy (vllm/sampling_params.py _SAMPLING_EPS)

# The Qwen3.5 / Qwen3.6 model cards' recommended settings (spec sampling.md section 2).
PRESETS: dict[str, dict[str, float | int]] = {
    "qwen-thinking": dict(
        temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5, repetition_penalty=1.0
    ),
    "qwen-thinking-coding": dict(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0, repetition_penalty=1.0
    ),
    "qwen-instruct": dict(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5, repetition_penalty=1.0
    ),
}
GENERATION_CONFIG = "generation-config"
# What vLLM takes from generation_config.json as default sampling parameters
# (vllm/config/model.py ModelConfig.get_diff_sampling_param; max_new_tokens is not a sampling field here).
_GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
_DRAWN_BY = ("hscache", "server", "vllm")


@dataclass(frozen=True)
class SamplingSetting:
    """How the cached continuations were drawn. ``temperature == 0``: greedy (the default).

    ``top_k`` -1 is vLLM's "disabled" (greedy only: a sampled cache stores the processed
    distribution exactly, which needs a top-k bound). ``support_width`` entries are stored per
    position: 2 * top_k, so ties at the k-th value (which vLLM keeps) fit.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    samples_per_prompt: int = 1
    preset: str | None = None  # qwen-thinking / ... / generation-config / None: flags only
    # hscache (seeded Gumbel-max here), server (--responses-from) or vllm (vLLM's sampler, --engine vllm)
    drawn_by: str = "hscache"
    engine: str = ENGINE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def support_width(self) -> int:
        """Stored support entries per position (0 for greedy)."""
        return 0 if self.greedy else 2 * self.top_k

    def to_dict(self) -> dict[str, Any]:
        """What a sampled cache records (manifest settings ``sampling``; schemas/manifest.schema.json)."""
        return {**asdict(self), "order": list(PROCESSING_ORDER), "support_width": self.support_width}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingSetting:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def describe(self) -> str:
        """One line: ``greedy (temperature 0)`` or every parameter, the seed and samples per prompt."""
        if self.greedy:
            return "greedy (temperature 0)"
        preset = f", preset {self.preset}" if self.preset else ""
        drawn = {
            "hscache": "drawn by hscache (seeded Gumbel-max)",
            "vllm": "drawn by vLLM's sampler (seeded per request)",
        }.get(self.drawn_by, "drawn by the server")
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k}, min_p {self.min_p:g}, "
            f"presence {self.presence_penalty:g}, frequency {self.frequency_penalty:g}, repetition "
            f"{self.repetition_penalty:g}, seed {self.seed}, {self.samples_per_prompt} sample(s) per prompt"
            f"{preset}; {self.engine} order, {drawn}"
        )

    def validate(self, vocab_size: int | None = None) -> SamplingSetting:
        """Refuse an out-of-range or inexact setting in one line; return ``self``.

        Raises:
            InputError: naming the flag, its value, the range and the fix.
        """
        for message in _problems(self, vocab_size):
            raise InputError(message)
        return self

    @classmethod
    def from_flags(
        cls,
        sampling: str | None = None,
        *,
        model: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        samples_per_prompt: int | None = None,
    ) -> SamplingSetting:
        """The setting of ``hscache extract``'s flags: a preset (``sampling``), then every flag given
        (not None) over it. ``sampling="generation-config"`` reads ``model``'s generation_config.json.

        Raises:
            InputError: an unknown preset, an unreadable generation_config.json, or a value out of
                range (``validate``).
        """
        base = _preset(sampling, model)
        given = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            seed=seed,
            samples_per_prompt=samples_per_prompt,
        )
        setting = replace(base, **{k: v for k, v in given.items() if v is not None})
        if setting.greedy and sampling not in (None, "greedy"):
            raise InputError(
                f"--temperature 0 with --sampling {sampling} is greedy, which takes no preset; drop one of them"
            )
        if setting.temperature == 0:  # and not a NaN, which validate names
            _refuse_greedy_extras(given)
            return GREEDY
        if setting.seed is None:
            setting = replace(setting, seed=DEFAULT_SEED)  # recorded: every run of the command draws the same
        return setting.validate()


GREEDY = SamplingSetting()


def sampling_setting(cache: Any) -> SamplingSetting:
    """The sampling setting of any ``CacheView`` (or a settings dict): ``GREEDY`` when it records none."""
    settings = cache if isinstance(cache, dict) else cache.settings
    recorded = settings.get("sampling")
    return SamplingSetting.from_dict(recorded) if isinstance(recorded, dict) else GREEDY


def generation_config_values(model: str | None) -> tuple[Path, dict[str, Any]]:
    """(path, the sampling fields vLLM takes) of ``model``'s generation_config.json.

    Raises:
        InputError: no model directory, no such file, or it is not a JSON object.
    """
    if not model or model.startswith("builtin:"):
        raise InputError(
            f"--sampling {GENERATION_CONFIG} reads the model directory's generation_config.json, and --model "
            f"{model} is not a directory; pass a model directory or the sampling flags"
        )
    path = Path(model) / "generation_config.json"
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(
            f"--sampling {GENERATION_CONFIG}: {path} does not exist; pass a preset or the sampling flags"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"--sampling {GENERATION_CONFIG}: {path} is not readable JSON ({exc})") from None
    if not isinstance(document, dict):
        raise InputError(f"--sampling {GENERATION_CONFIG}: {path} is not a JSON object")
    return path, {k: document[k] for k in _GENERATION_CONFIG_KEYS if k in document}


def _preset(sampling: str | None, model: str | None) -> SamplingSetting:
    if sampling is None or sampling == "greedy":
        return GREEDY
    if sampling == GENERATION_CONFIG:
        path, values = generation_config_values(model)
        bad = [k for k, v in values.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
        if bad:
            raise InputError(
                f"--sampling {GENERATION_CONFIG}: {path} has a non-numeric {bad[0]} ({values[bad[0]]!r})"
            )
        # vLLM's request defaults for what the file leaves out (vllm/entrypoints/openai/completion/protocol.py).
        return replace(SamplingSetting(temperature=1.0, preset=GENERATION_CONFIG), **values)
    if sampling not in PRESETS:
        choices = ", ".join(["greedy", GENERATION_CONFIG, *PRESETS])
        raise InputError(f"--sampling {sampling!r} is not a preset; choose one of {choices}")
    return SamplingSetting(**PRESETS[sampling], preset=sampling)


def _refuse_greedy_extras(given: dict[str, Any]) -> None:
    """At temperature 0 the continuation is the argmax chain: a truncation, a penalty or a seed would be
    silently ignored, and N samples would be N identical trajectories."""
    defaults = asdict(GREEDY)
    extras = [k for k, v in given.items() if v is not None and k != "temperature" and v != defaults[k]]
    if extras:
        flag = "--" + extras[0].replace("_", "-")
        raise InputError(
            f"{flag} {given[extras[0]]} does nothing at temperature 0 (greedy: the argmax chain, "
            f"{'identical trajectories' if extras[0] == 'samples_per_prompt' else 'no sampling'}); pass "
            "--temperature T > 0 or a --sampling preset, or drop it"
        )


def _problems(s: SamplingSetting, vocab_size: int | None) -> list[str]:
    """Every way ``s`` is out of range, as one-line messages (the first is raised)."""
    out = []

    def number(name: str, value: Any) -> bool:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            out.append(f"--{name.replace('_', '-')} {value!r} must be a finite number")
        return ok

    if number("temperature", s.temperature) and (s.temperature < 0 or 0 < s.temperature < SAMPLING_EPS):
        out.append(
            f"--temperature {s.temperature:g} must be 0 (greedy) or at least {SAMPLING_EPS:g} (vLLM samples "
            "greedily below it); pass 0 or a larger temperature"
        )
    for name, low, high, low_open in (
        ("top_p", 0.0, 1.0, True),
        ("min_p", 0.0, 1.0, False),
        ("presence_penalty", -2.0, 2.0, False),
        ("frequency_penalty", -2.0, 2.0, False),
        ("repetition_penalty", 0.0, 2.0, True),
    ):
        value = getattr(s, name)
        if number(name, value) and not ((low < value if low_open else low <= value) and value <= high):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            out.append(f"--{name.replace('_', '-')} {value:g} must be in {interval} (as vLLM requires)")
    out += _top_k_problems(s, vocab_size)
    if not isinstance(s.samples_per_prompt, int) or s.samples_per_prompt < 1:
        out.append(f"--samples-per-prompt {s.samples_per_prompt!r} must be at least 1")
    elif s.greedy and s.samples_per_prompt > 1:
        out.append(
            f"--samples-per-prompt {s.samples_per_prompt} at temperature 0 gives identical trajectories; "
            "pass --temperature T > 0 or a --sampling preset, or drop --samples-per-prompt"
        )
    if s.seed is not None and (
        not isinstance(s.seed, int) or isinstance(s.seed, bool) or not 0 <= s.seed < 2**63
    ):
        out.append(f"--seed {s.seed!r} must be an integer in 0..2^63-1")
    if not s.greedy and s.seed is None and s.drawn_by in ("hscache", "vllm"):
        out.append("a sampled extraction needs a seed: its draws are keyed by it (pass --seed S)")
    if s.drawn_by not in _DRAWN_BY or s.engine != ENGINE:
        out.append(
            f"sampling drawn_by {s.drawn_by!r} / engine {s.engine!r}: expected one of {_DRAWN_BY} / {ENGINE}"
        )
    return out


def _top_k_problems(s: SamplingSetting, vocab_size: int | None) -> list[str]:
    k = s.top_k
    if not isinstance(k, int) or isinstance(k, bool):
        return [f"--top-k {k!r} must be an integer"]
    if k == 0 or k < -1:
        return [f"--top-k {k} must be -1 (disabled) or at least 1 (as vLLM requires); Qwen's presets use 20"]
    if k == -1 and not s.greedy:
        return [
            "sampling with top-k disabled (--top-k -1, vLLM's default) leaves the processed distribution "
            "the whole vocabulary, and exact scoring stores it per position: pass --top-k K (Qwen's "
            "presets use 20)"
        ]
    if vocab_size is not None and k > vocab_size:
        return [f"--top-k {k} is larger than the model's vocabulary of {vocab_size}"]
    return []
