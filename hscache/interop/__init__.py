"""Export a cache to the peers' offline training formats (speculators, SpecForge) and import theirs."""
