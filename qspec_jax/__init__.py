"""qspec-jax: QuantSpec-style self-speculative decoding for long-context LLMs in JAX/Pallas."""
