"""Structured output: grammars (llguidance) that make a request's tokens valid JSON, a regex
match, one of several choices or a grammar's sentence; see `grammar.py` and `manager.py`."""
