"""User-facing entry points: the `LLM` class, the CLI, the OpenAI server, the batch runner."""
