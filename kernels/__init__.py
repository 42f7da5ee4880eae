"""Kernels, each next to its PyTorch reference and tested against it; import from the submodules
(`from kernels.attention_paths import attend`), which import Triton only where a kernel runs:

    kernels.attention_paths  attention with b_Q, b_V on three exact paths, and which one a run takes
    kernels.attention        the Triton attention kernel with b_Q, b_V (FlashAttention-2 style)
    kernels.ecd              the fused ECD step: the step's dot products in one pass, the update in another
    kernels.soap             the fused elementwise step of SOAP: Adam's moments in the eigenbasis in one pass
    kernels.bf16             bf16 optimizer state inside Triton kernels, with stochastic rounding

What the attention kernel (kernels/attention.py) and the choice of its path (kernels/attention_paths.py) both need
is written here, so that neither module imports the other and choosing a path never imports Triton."""

ATTENTION_HEAD_DIMS = (64, 128)  # the head dims the Triton attention kernel is built for
