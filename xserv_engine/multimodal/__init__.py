"""Images for vision-language checkpoints (Qwen3-VL, Qwen3.5): decoding and preprocessing
(image_processor.py), the vision encoder (vision_encoder.py)."""
