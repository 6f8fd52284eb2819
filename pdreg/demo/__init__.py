"""`pdreg demo`: a local elastic P/D cluster, steady traffic and a scripted scenario.

    cluster.py   processes on loopback (registry, router, engines), each in its own group
    traffic.py   a steady OpenAI-compatible streaming load with counters and TTFT
    observer.py  timelines sampled from the registry and the router (ready, picks, gone)
    scenario.py  the steps and their expectations; the demo and the e2e test share it
    display.py   what a person sees while it runs
"""
