"""Inference: the InferenceEngine, offline prediction, the HTTP server with dynamic batching, and a load tester."""
