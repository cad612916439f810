"""Structured outputs: grammar specs, their compilation (llguidance) and the token masks they put on logits."""
