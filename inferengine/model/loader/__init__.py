"""Weight sources: local safetensors folders, hub ids, GGUF files, dummy weights, aliases."""
