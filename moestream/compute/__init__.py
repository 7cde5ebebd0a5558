"""Compute: quantized linear layers and the native kernels behind them."""
