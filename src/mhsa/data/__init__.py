"""Built-in datasets and tokenizers for the CLI tasks (nothing is downloaded)."""
