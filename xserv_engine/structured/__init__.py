"""Structured outputs: grammar-constrained decoding (JSON schema, JSON object, regex, Lark grammar,
choice, forced tool calls) behind a small backend interface; llguidance is the backend."""

from xserv_engine.structured.constraint import Constraint

__all__ = ["Constraint"]
