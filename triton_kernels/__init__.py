"""Triton kernels for ZeRO++'s quantized communication (blockwise INT8/INT4 quantization, the fused
reorder-quantize of the hierarchical gradient all-to-all, fused dequantize-reduce-requantize).

Each kernel will come with a torch reference of the same semantics, used on CPU tensors and as the
test oracle; CUDA tensors go to the Triton kernel. The kernels are the subject of their own
milestone; nothing is exported yet.
"""

__all__: list[str] = []
