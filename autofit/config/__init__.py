"""What a run is: `TrialConfig` and its dimensions (each declared once), search spaces, model sources, where
probes run (the target and its memory), and the training arguments the probe and every exported recipe share.
"""
