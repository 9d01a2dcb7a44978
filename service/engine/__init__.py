"""Inference engines: asyncio, iteration-level batching over the slot KV cache. No Ray import here."""
