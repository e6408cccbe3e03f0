"""xserv engine: Qwen3 in torch with a paged KV cache, continuous batching and a gRPC service.

Importing this package does not import torch; the CLI and the REST front rely on that.
"""
