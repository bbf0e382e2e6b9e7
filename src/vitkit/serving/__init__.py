"""Shipping a model: ONNX export checked by onnxruntime, and the browser demo."""
