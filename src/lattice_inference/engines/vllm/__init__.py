"""The vLLM engine: our options mapped onto vLLM's, run in vLLM's own interpreter.

- `mapping`: pure translation of `DecodeOptions`, `SamplingOptions` and the server flags into vLLM's engine
  flags, ``speculative_config`` and ``SamplingParams``; whatever vLLM cannot honour is a `ConfigError` naming it.
- `runtime`: which interpreter runs vLLM, the environment it runs in, and the model folder it reads.
- `worker`: the script that runs inside that interpreter (stdlib and vLLM only) and generates a batch of jobs.
- `batch`: this side of the worker (``lattice generate`` and ``lattice bench`` with ``--engine vllm``).
- `server`: ``lattice serve --engine vllm``, which starts vLLM's own OpenAI-compatible server.
"""
