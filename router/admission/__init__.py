"""Overload admission in front of pairing (router/admission/gate.py has the rules).

    classes     traffic classes, API keys and `--classes FILE`
    fair_queue  the bounded queue: strict priority, starvation guard, VTC across tenants
    budgets     units in flight per member, grants released exactly once
    predict     TTFT at admission, from the prefills' measured speed
    shares      this router's share of each member's budget: limits, reservations, the
                pair's grants (`charge`), the members that are full
    gate        `Admission`: admit, queue, shed, refuse; pump; report
    tickets     `Cost`, `Who`, `Ticket`: what admission takes and hands back
    requests    a request's class, tenant and cost, read off the HTTP request
    options     `AdmissionOptions` (RouterConfig.admission)
    metrics     its series
"""
