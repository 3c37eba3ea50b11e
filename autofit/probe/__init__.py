"""The probe: the parent side (`runner`: starts each probe in a process of its own, enforces its timeout,
judges what it left) and the child side (`child/`: the only code that imports torch, run as
`python -m autofit.probe.child`). No module imports the child side; the runner starts it as a command.
"""
