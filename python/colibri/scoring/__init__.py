"""Closed-set scoring: answers chosen from the caller's own options by the model's
log-probabilities (``/v1/brio``), never by generating. ``prompts`` builds the texts,
``maths`` turns log-probabilities into choices; ``runtime/scoring.py`` runs them on the engine."""
