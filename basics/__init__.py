"""What every layer shares, below them all: the one-line error a bad input gets (errors.py)
and the readers of a user's files (user_files.py: regular files only, bounded, JSON depth and
text checked). Imports nothing of the tool."""
