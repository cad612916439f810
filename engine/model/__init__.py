"""The Llama-family decoder that runs over the KV pool."""
