"""Building blocks shared by the model definitions (linear layers, norms, rotary, activations)."""
