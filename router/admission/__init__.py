"""Admission: what stands between a valid request and its generation slots.

- `control`: `AdmissionControl`, run by the Router for each request: quota, prediction, SLOs,
  then a Ticket in the slot queue;
- `fair`: the slot queue, in fair order (its rules are the ledger shared with the engines,
  workers/engine/fairness.py);
- `tenants`: each tenant's weight, tier, caps and quota;
- `predictor`: each request's output length, learned online.
"""
