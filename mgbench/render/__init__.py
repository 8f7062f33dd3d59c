"""Output for people and CI: the terminal (consoles, progress, tables), report.md, plots, JUnit."""
