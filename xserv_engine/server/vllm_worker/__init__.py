"""SMG's vLLM worker service (vllm.grpc.engine.VllmEngine from smg-grpc-proto): lets the SGLang
Model Gateway route to this engine in gRPC mode (docs/scale-out.md)."""
