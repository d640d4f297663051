"""Offline scoring of DFlash drafters against hidden-state caches."""
