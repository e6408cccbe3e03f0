"""xserv REST front: the OpenAI API over HTTP (Falcon WSGI under gunicorn) in front of engines.

It speaks to engines over gRPC only and never imports torch, so it runs on CPU-only boxes.
"""
