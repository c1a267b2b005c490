"""The sparse-training engine: pure torch, no printing, no file IO beyond loading a quantized model."""
