"""Kernels, each next to its PyTorch reference and tested against it; import from the submodules
(`from kernels.attention import attention`): a re-export here would shadow the `kernels.attention` module."""
