"""The REST API's bodies as pydantic models (as vLLM's protocol.py and the openai SDK's types):
requests validate and build their GenerateRequest, answers serialize, and /openapi.json is
generated from them."""
