"""Fake (meta) kernels of the engine's custom ops, so `torch.compile` can trace around them.

Import this package before compiling anything that calls an `ember::` op.
"""
from kernels_fake import attention as _attention  # noqa: F401  (registers on import)
from kernels_fake import linear as _linear  # noqa: F401
from kernels_fake import linear_gguf as _linear_gguf  # noqa: F401
from kernels_fake import moe as _moe  # noqa: F401
