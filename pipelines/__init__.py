"""End-to-end flows built from hscache (stage one) and scorer (stage two)."""
