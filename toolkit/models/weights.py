"""The weight-file helpers live in toolkit/engines/weights.py (the engines save and load weights, and a layer
may not import the one above it); these names stay importable from here while toolkit/train imports them
from this module."""

from toolkit.engines.weights import load_model, mismatch_sentence, refusal_reason, save_model, unwrap_model

__all__ = ["load_model", "mismatch_sentence", "refusal_reason", "save_model", "unwrap_model"]
