"""Config time: the checks a run makes before it builds any model, and the parser's errors in a user's words.

``keys`` (unknown keys and class paths, with the nearest valid one), ``reports`` (what a
jsonargparse error is about), ``preflight`` (every check before the build); docs/reliability.md.
"""
