"""Stage two: replay DFlash drafter checkpoints against a cache (any ``CacheView``) and report tau, acceptance, DDTree."""
