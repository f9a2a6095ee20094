"""Simulators and side-by-side harnesses the tests drive data planes with (kept out of test modules)."""
