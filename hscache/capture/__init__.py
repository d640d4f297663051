"""Stage one, capture: load the target, pick backend and layers, run it, hand rows to the store (target -> capture -> extract)."""

# --backend names (capture/backend.py resolves them); here so the CLI can list them without torch.
BACKENDS = ("auto", "fla", "torch")
# --model names of the built-in targets (capture/builtin.py builds them), listed without torch.
BUILTIN_TARGETS = ("builtin:tiny-qwen3.5", "builtin:tiny-qwen3")
# Their decoder layers (builtin.builtin_config's num_hidden_layers), known without torch so that
# --layers is checked before the model loads (capture/preflight.py; a test compares the two).
BUILTIN_LAYERS = {"builtin:tiny-qwen3.5": 8, "builtin:tiny-qwen3": 8}
# and their context (max_position_embeddings), which bounds a tree verified in one forward
BUILTIN_CONTEXT = {"builtin:tiny-qwen3.5": 4096, "builtin:tiny-qwen3": 4096}
