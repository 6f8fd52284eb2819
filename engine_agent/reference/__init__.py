"""The reference engine: a small OpenAI-compatible engine that speaks both P/D handshakes.

It exists so that the whole prefill/decode path runs for real on a CPU, in tests, in the
demo and in benchmarks, with many engines on one machine. Modules, one job each:

- `tokens`      byte-level tokens, the chat template, incremental detokenizing
- `model`       a tiny decoder-only transformer in plain torch (weights from the model name)
- `backend`     what the engine needs from a compute backend, and sampling parameters
- `torch_backend`, `sim`  the two backends: real torch compute, or timed stand-ins
- `scheduler`   bounded concurrency, a waiting queue, and the load figures
- `kv_store`    prefilled KV held for a peer to pull, under a lease
- `kv_transfer` the KV wire format and its ZeroMQ server/client (no pickle)
- `bootstrap`   SGLang's bootstrap port: where a decode finds a prefill's KV server
- `engine`      one request's life: prefill or fetch, then decode, for each handshake
- `openai_api`  request parsing and response shapes (vLLM-compatible extras)
- `server`      the aiohttp routes, /metrics, and the probes peer routers make
- `runner`      start-up, registration, readiness and drain on SIGTERM
"""
