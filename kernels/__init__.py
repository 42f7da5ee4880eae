"""Kernels, each next to its PyTorch reference and tested against it; import from the submodules
(`from kernels.attention_paths import attention`), which import Triton only where a kernel runs."""
