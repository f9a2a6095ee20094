"""aggctl sub-command groups, one module each."""
