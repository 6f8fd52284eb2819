"""Overload admission in front of pairing (router/admission/gate.py has the rules).

    classes     traffic classes, API keys and `--classes FILE`
    fair_queue  the bounded queue: strict priority, starvation guard, VTC across tenants
    budgets     units in flight per member, grants released exactly once
    predict     TTFT at admission, from the prefills' measured speed
    gate        `Admission`: admit, queue, shed, refuse; charge the pair; pump
    requests    a request's class, tenant and cost
    options     `AdmissionOptions` (RouterConfig.admission)
    metrics     its series
"""
