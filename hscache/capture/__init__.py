"""Stage one, capture: load the target, pick backend and layers, run it, hand rows to the store (target -> capture -> extract)."""

# --backend names (capture/backend.py resolves them); here so the CLI can list them without torch.
BACKENDS = ("auto", "fla", "torch")
# --model names of the built-in targets (capture/builtin.py builds them), listed without torch.
BUILTIN_TARGETS = ("builtin:tiny-qwen3.5", "builtin:tiny-qwen3")
