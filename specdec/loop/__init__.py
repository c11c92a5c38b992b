"""The decoding loop: in-flight batching, proposers, adaptive k, verification."""
