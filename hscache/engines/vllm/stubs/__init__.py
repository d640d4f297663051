"""Import-only stand-ins put on a vLLM engine's path when the real package is missing (torchvision/)."""
