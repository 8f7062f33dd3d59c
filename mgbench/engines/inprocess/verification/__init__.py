"""Verification: how a policy decides which steps to check (gates), against which reference, and
how a caught flip is repaired (verifiers), run by one free-running decode loop (`loop.py`)."""
