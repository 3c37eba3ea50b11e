"""The probe child: the only side of autofit that imports torch (`main.py`: the standby loop; `measure.py`:
one probe). Started by the runner as `python -m autofit.probe.child --standby`.
"""
