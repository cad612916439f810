"""Custom CPU ops of the `ember` namespace. Their fake (meta) kernels live in `kernels_fake/`."""
