"""Parse ``--layers``: explicit 0-based decoder-layer ids, or the DFlash rule.

"Layer i" is the OUTPUT of decoder layer i (0-based), which is transformers'
``hidden_states[i + 1]`` without the final norm (spec section 1).
"""

from __future__ import annotations

from hscache.errors import LayerSpecError

__all__ = ["check_layer_syntax", "dflash_layer_ids", "parse_layer_spec"]


def dflash_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The DFlash rule: ``[L // 2]`` for one feature, else ``round(1 + i * (L - 4) / (n - 1))``.

    Example: 36 target layers, 5 features -> [1, 9, 17, 25, 33].
    """
    if num_features < 1:
        raise LayerSpecError(f"dflash:{num_features} asks for no layers; use dflash:N with N >= 1")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_features > num_target_layers:  # more features than layers: never distinct
        # Refused before the ids are expanded: dflash:30000000 took 65 s and printed 90 MB (issue 52).
        raise LayerSpecError(
            f"a target with {num_target_layers} layers is too small for {num_features} DFlash features; "
            "ask for fewer (dflash:N) or list the layer ids"
        )
    span = num_target_layers - 4
    ids = [round(1 + i * span / (num_features - 1)) for i in range(num_features)]
    if len(set(ids)) != len(ids) or not all(0 <= i < num_target_layers for i in ids):
        # The rule spreads N ids over layers 1..L-3: it needs roughly N <= L - 3 distinct layers.
        raise LayerSpecError(
            f"a target with {num_target_layers} layers is too small for {num_features} DFlash "
            f"features (the rule gives {ids}); ask for fewer (dflash:N) or list the layer ids"
        )
    return ids


def check_layer_syntax(spec: str) -> int | list[int]:
    """The form of ``--layers`` alone, before the model is known: ``N`` of ``dflash:N``, or the ids.

    Raises:
        LayerSpecError: malformed, empty or duplicated ids.
    """
    text = spec.strip()
    if text.startswith("dflash:"):
        count_text = text.removeprefix("dflash:")
        if not (count_text.isascii() and count_text.isdigit() and len(count_text) <= 9):
            raise LayerSpecError(
                f"--layers {spec[:80]!r}: expected dflash:N with N a positive integer below 10^9, e.g. dflash:5"
            )
        return int(count_text)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise LayerSpecError("--layers is empty; give comma-separated layer ids such as 1,9,17 or dflash:5")
    try:
        layer_ids = [int(p) for p in parts]
    except ValueError:
        raise LayerSpecError(
            f"--layers {spec[:80]!r} is not a comma-separated list of integers; e.g. 1,9,17 or dflash:5"
        ) from None
    seen: set[int] = set()
    dupes = [i for i in layer_ids if i in seen or seen.add(i)]
    if dupes:
        raise LayerSpecError(
            f"layer {dupes[0]} is listed twice in --layers {spec[:80]!r}; list each layer once"
        )
    return layer_ids


def parse_layer_spec(spec: str, num_target_layers: int) -> list[int]:
    """Turn ``"1,9,17"`` or ``"dflash:5"`` into validated layer ids, in the given order.

    Raises:
        LayerSpecError: malformed, out of range (names the valid range) or duplicated ids.
    """
    parsed = check_layer_syntax(spec)
    layer_ids = dflash_layer_ids(num_target_layers, parsed) if isinstance(parsed, int) else parsed
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise LayerSpecError(
            f"layer {bad[0]} out of range for a target with {num_target_layers} layers; "
            f"choose 0-{num_target_layers - 1} (layer i is the output of decoder layer i)"
        )
    return layer_ids
