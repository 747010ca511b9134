"""Turning logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""
