"""The search: the driver (ask, pre-check, probe, tell), what is known, which probe comes next, the Optuna
study, the objective, and the search replayed on recorded landscapes.
"""
