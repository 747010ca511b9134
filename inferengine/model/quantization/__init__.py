"""Quantized weights: the seam between a weight format and the layers (`base`: a model's
`QuantizationConfig` gives each layer its `QuantMethod` at construction), the checkpoint formats
we read (`formats`: AWQ `awq`, GPTQ `gptq`, compressed-tensors `compressed_tensors`, over
`int_weights`), which config a load builds (`choose`), the FP8 method (`fp8`), and the
accuracy comparison against the unquantized model (`compare`)."""
