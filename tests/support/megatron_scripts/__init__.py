"""Helpers of tests/trainer/test_megatron_backend.py that also run under `torch.distributed.run`."""
