"""Attention metadata, the attention layer and its backends."""
