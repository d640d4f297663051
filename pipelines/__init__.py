"""Flows built from both stages: the drift study and sharded extraction (nothing in hscache or scorer imports them)."""
