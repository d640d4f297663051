"""The old path of ``scorer.online.sampled`` (moved 2026-12-03, issue 32), kept for one release so that
``from scorer.online_sampled import SampledOnlineConfig, run_online_sampled`` still works;
``docs/renames.sed`` rewrites such imports. New code imports ``scorer.online.sampled``."""

from scorer.online.sampled import SampledOnlineConfig, run_online_sampled

__all__ = ["SampledOnlineConfig", "run_online_sampled"]
