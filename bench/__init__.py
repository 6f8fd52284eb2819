"""pdreg's benchmarks, and the parts they share.

Each `bench_*.py` is a command (`.venv/bin/python bench/bench_x.py --help`); the parts
they stand on are modules of this package, for new benchmarks to reuse:

- `bench.procs`: processes: a `pdreg registry` or `pdreg router` child, the CPU, run-queue
  wait and memory of a process, its threads or its tree, another commit's source tree,
  waiting for a quiet machine;
- `bench.load`: load generation: closed loops of HTTP requests (`closed_loop`), one
  request's time to first token, whether a target serves yet;
- `bench.tables`: percentiles and Markdown tables, JSON results;
- `bench.peers`: the peer routers (sglang-router, vllm-router) in `.venv-peers`;
- `bench.scale`: the fleet-scale load generator (a fleet of members speaking ZMTP),
  subscribers and views, as `bench_scale.py` runs them.

bench/README.md says how to write a new benchmark with them.
"""
