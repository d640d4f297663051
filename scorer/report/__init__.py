"""Scorer reports: build the JSON document, render it for the terminal, HTML pages, sweep tables."""
