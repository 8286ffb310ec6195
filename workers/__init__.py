"""Tandem workers: the model, the engine, and the prefill and decode actors built on them."""
