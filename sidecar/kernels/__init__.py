"""Hand-written device kernels and layer formulations for the decoders' hot spots: ``snake.py`` (Snake + the
conv's state concatenation, optionally adding a bias to its input in place), ``snake_conv.py`` (Snake + a conv to
one channel) and ``depthwise.py`` (a depthwise conv + Snake), torch library ops; ``dilated.py`` (dilated convs in
the faster of two forms, measured per shape)."""
