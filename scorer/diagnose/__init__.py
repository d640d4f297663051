"""``scorer diagnose``: name the setting behind a low tau.

``ranking`` holds the hypotheses and how they are ranked (the families' ``diagnose`` hooks fill
``DiagnosisInputs`` -> ``FamilyDiagnosis``); ``run`` loads a checkpoint and a cache and runs them.
"""
