"""From-scratch Transformer models: decoder-only LM and encoder-decoder, with a slot KV cache."""
