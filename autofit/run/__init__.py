"""A run folder and the work on it: the folder and its locks, the session that starts, resumes or joins a
search, the report, and the nightly re-measurement.
"""
