"""Falcon resources: thin (parse, call the engine, render)."""
