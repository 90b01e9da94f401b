"""Runtime hosts that execute the scheduler's iteration plans on a real model.

`tiny_model` writes a small random-weight LLaMA GGUF (offline, deterministic by seed) and
`llama` drives llama.cpp through `llama-cpp-python` (the optional `llama` extra). Importing this
package does not import `llama_cpp`; only `skippy_scheduler.hosts.llama` does.
"""
