"""The engine: block pool, scheduler, sampler and model runner; `LLMEngine` ties them together.

The block pool and scheduler are plain bookkeeping (no torch, no Ray) and are tested alone.
"""
