"""In-process tests: autofit's decisions, files and commands called as functions, no process started (the
fast inner loop: `pytest tests/unit`)."""
