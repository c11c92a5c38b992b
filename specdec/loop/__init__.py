"""The decoding loop: in-flight batching, proposers, adaptive k, rejection sampling."""
