"""The foundation, below every other package: the exception hierarchy and exit codes, sizes and durations
people type, files written whole or not at all, paths checked before use, and the versions a bug report needs.
"""
