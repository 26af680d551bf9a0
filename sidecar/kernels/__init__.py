"""Hand-written device kernels and layer formulations for the decoders' hot spots. Torch library ops:
``snake.py`` (Snake + the conv's state concatenation, optionally adding biases to its input; its Triton kernels in
``snake_kernels.py``), ``snake_conv.py`` (Snake + a conv to one channel), ``depthwise.py`` (a depthwise conv +
Snake) and ``conv_gemm.py`` (a dense conv as an implicit GEMM, Snake in its epilogue). Forms: ``dilated.py`` (a
dilated conv over its input's phases) and ``conv_choice.py`` (which form each conv runs in, measured per shape)."""
