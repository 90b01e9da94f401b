"""What the benchmark scripts of bench/ share: the scripts are thin over these modules.

- `servers`: server processes on free loopback ports (start, wait until healthy, stop),
  finding llama-server, `skippy-scheduler run` in this Python;
- `loads`: one streamed completion request as a client sees it, the closed-loop load;
- `open_loop`: the open-loop load, a slice of a trace replayed at its arrival times;
- `reports`: nearest-rank percentiles, medians, JSON lines, markdown tables;
- `models`: the random-weight bench models the comparisons run on;
- `llama_context`: a bare llama.cpp context for timing `llama_decode` alone;
- `callgrind`: instruction counts of a child process under valgrind;
- `fleet_trace`: what each replica of a fleet held, from its KV events;
- `rpc_split`: llama.cpp's own split (ggml-rpc-server devices under one llama-server).

A script run as `python bench/NAME.py` has bench/ on its path, so `import skippy_bench` needs
no path edits; tests put bench/ on `sys.path` (tests/bench_tools/conftest.py).
"""
