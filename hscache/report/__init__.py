"""The one home for HTML and SVG output: page/table primitives, charts, and the diff report page."""
