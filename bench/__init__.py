"""Benchmarks, each a command (`python -m bench.NAME`); results in BENCHMARKS.md, measured GPU throughput in
bench/throughput.json. Nothing is imported here:

    bench.e2e             end-to-end training throughput of a preset on this device: tokens/s, step time, MFU
    bench.attention       every attention implementation side by side, against the fastest library path (CUDA)
    bench.kernels         every shipped Triton kernel configuration built offline for sm_90 and sm_80, no GPU needed
    bench.optim           an optimizer step's time and state bytes per parameter, beside the published implementations
    bench.soap_parity     our SOAP against the published SOAP on a GPT: how far the two trajectories end apart
    bench.gauge           one optimizer step with each --gauge mode against the bare step
    bench.sample          sampling throughput with and without the KV cache, and that both give the same tokens
    bench.tokenize        data.tokenize against single-process tiktoken
    bench.throughput      the measured GPU throughput rows, and the wall time of a grid they give
    bench.gpu_session     measuring and testing a GPU in one command of at most 10 minutes (bench/gpu_session.sh)
    bench.session_env     its first step: the interpreter, torch, CUDA, Triton and the GPU it will use
    bench.session_tests   its pytest plugin: each test's start and verdict written as it happens
    bench.session_report  its report as Markdown, ending with the changes its numbers justify as one diff
"""
