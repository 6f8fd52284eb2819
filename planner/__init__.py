"""`pdreg planner`: how many prefills and decodes each model should have, and why.

    rule       the pure decision: HPA-style votes, tolerance, stabilization, bounds
    histogram  windowed quantiles from the routers' cumulative histograms
    inputs     membership -> per (model, role) fleets; the routers to scrape
    smoothing  load averaged over a short window
    scrape     fetching and parsing the routers' /metrics
    metrics    the planner's own Prometheus gauges and counters
    hook       the `--exec CMD MODEL ROLE N` command hook
    service    the loop and the HTTP face (/v1/plan, /metrics, /health)
"""
