"""Helpers shared by the test modules, imported one way: `from support.X import ...` (tests/conftest.py puts
tests/ on sys.path).

- `support.engines`: requests as the rollout manager builds them, teacher-forced logprobs, served engines.
- `support.engine_doubles`: the hand-written engine doubles (test stand-ins for the `Engine` protocol).
- `support.cluster`: the distributed-run tests' config, records and waits.
- `support.gguf_files`: GGUF files written as llama.cpp writes them.
- `support.families`: chat templates, tokenizers and tiny checkpoints of the major model families.
- `support.megatron_scripts`: the Megatron checks, also run under `torch.distributed.run`.
- `support/fake_sglang_server.py`: a named fake of SGLang's launch command, run as a process by its path.
- `support/openenv_servers.py`: small envs served by OpenEnv's own server, run as processes of `.venv-openenv`.
"""
