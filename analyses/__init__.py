"""Analyses over a HookedDecoder (logit lens, attribution, patching, ...)."""
