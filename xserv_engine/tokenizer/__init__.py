"""Tokenization, chat templates, incremental detokenization and stop strings."""
