"""The CPU speed work, on the lowest floor: what makes torch fast on a CPU in this project's processes.

- `process`: `prepare_process()`, the process-wide settings every relax_gym process runs with (one malloc heap for
  all threads, large blocks kept), and `settle_heap()` once its models are loaded;
- `threads`: which cores a role's thread runs on, and its idle OpenMP workers released;
- `native_heap`: glibc's heap settings and trimming after a training step;
- `onednn_linear`: `nn.Linear` products through oneDNN;
- `decode_attention`, `decode_kernel`: one-query-token attention for continuous batching (a C loop built on first
  use).

Each path checks at run time what the machine has (oneDNN in torch, a C compiler, glibc, libgomp) and falls back
to torch's own where it lacks it, so the same code is correct on AMD (AVX2) and Intel (AVX-512, AMX) CPUs.
"""
