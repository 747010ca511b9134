"""Quantized weights: the checkpoint formats we read (`formats`), the FP8 linear method
(`fp8`), and the accuracy comparison against the unquantized model (`compare`)."""
