"""Hand-written device kernels for the decoders' hot spots, registered as torch library ops (``snake.py``)."""
