"""Applications built on the models: what the `mhsa` commands run.

chat.py, embed.py, transcribe.py, export.py, train.py; serve/ (continuous batching and
the OpenAI-compatible server); viz/ (attention maps and the HTML explorer).
"""
