"""Hand-written device kernels and layer formulations for the decoders' hot spots: ``snake.py`` (Snake + the
conv's state concatenation) and ``snake_conv.py`` (Snake + a conv to one channel), torch library ops;
``dilated.py`` (dilated convs in the faster of two forms, measured per shape)."""
