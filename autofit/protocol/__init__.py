"""The probe protocol: what crosses the process boundary (a `ProbeRequest` in, a `ProbeResult` out) and how
an outcome is judged from what a probe left behind (error signatures, evidence of the OOM killer, ranks judged
as one group).
"""
