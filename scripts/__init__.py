"""Scripts run from the repository root (``python -m scripts.gpu.check_local``, ...)."""
