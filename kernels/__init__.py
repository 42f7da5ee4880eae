"""Kernels, each next to its PyTorch reference and tested against it; import from the submodules
(`from kernels.attention_paths import attention`), which import Triton only where a kernel runs.

What the attention kernel (kernels/attention.py) and the choice of its path (kernels/attention_paths.py) both need
is written here, so that neither module imports the other and choosing a path never imports Triton."""

ATTENTION_HEAD_DIMS = (64, 128)  # the head dims the Triton attention kernel is built for
