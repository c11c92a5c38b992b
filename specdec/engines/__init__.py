"""The engines: torch, onnxruntime and TensorRT decoders over slot KV caches, and sampling."""
